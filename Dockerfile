# moeserve CPU image (Debian 12), multi-stage:
#   build   - installs the toolchain with scripts/setup.sh (as CI does), builds moeserve and
#             moeserve-cli, and checks with ldd that docker/runtime-packages-cpu.txt provides
#             every shared library they need (scripts/docker/runtime_packages.sh --check)
#   runtime - debian:bookworm-slim with only those packages and the two binaries, non-root
# The CUDA image is Dockerfile.cuda. Usage:
#   docker build -t moeserve --build-arg MOESERVE_GIT_DESCRIBE="$(git describe --always --dirty)" .
#   docker run --rm -p 50051:50051 -p 9464:9464 moeserve --model tiny
# The entrypoint listens on 0.0.0.0:50051 (gRPC: moeserve.v1, KServe v2, health) and serves
# Prometheus metrics on 0.0.0.0:9464; arguments are appended (later flags win). Reflection and
# GetExpertWeights stay off unless flags turn them on; TLS and tokens: docs/security.md.
FROM debian:bookworm AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# .git is not in the build context (.dockerignore): the commit comes in as an argument.
ARG MOESERVE_GIT_DESCRIBE=unknown
ARG BUILD_TYPE=RelWithDebInfo
WORKDIR /src
COPY scripts/setup.sh scripts/setup.sh
RUN apt-get update -qq && \
    apt-get install -y -qq --no-install-recommends python3 python3-pip ca-certificates >/dev/null && \
    MOESERVE_SETUP_PYTHON=0 scripts/setup.sh && \
    rm -rf /var/lib/apt/lists/*
COPY . .
RUN BUILD_DIR=/build BUILD_TYPE=${BUILD_TYPE} scripts/build.sh -DMOESERVE_BUILD_TESTS=OFF \
      -DMOESERVE_BUILD_BENCHMARKS=OFF -DMOESERVE_ENABLE_CUDA=OFF \
      -DMOESERVE_GIT_DESCRIBE="${MOESERVE_GIT_DESCRIBE}" && \
    scripts/docker/runtime_packages.sh --check docker/runtime-packages-cpu.txt \
      /build/bin/moeserve /build/bin/moeserve-cli && \
    strip --strip-debug /build/bin/moeserve /build/bin/moeserve-cli

FROM debian:bookworm-slim AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY docker/runtime-packages-cpu.txt /tmp/runtime-packages.txt
# Versions come from the Debian 12 release the build stage used (same archive, same day).
RUN apt-get update -qq && \
    sed -e 's/#.*//' -e '/^[[:space:]]*$/d' /tmp/runtime-packages.txt | \
      xargs apt-get install -y -qq --no-install-recommends >/dev/null && \
    rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt && \
    useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin moeserve
COPY --from=build /build/bin/moeserve /build/bin/moeserve-cli /usr/local/bin/
# Every library resolves in this stage too.
RUN if ldd /usr/local/bin/moeserve /usr/local/bin/moeserve-cli | grep 'not found'; then exit 1; fi
USER 10001:10001
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/moeserve", "--listen", "0.0.0.0:50051", \
            "--metrics_address", "0.0.0.0:9464"]
