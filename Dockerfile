# moeserve CPU image (Debian 12). GPU images build the same tree on a CUDA base with nvcc.
#   docker build -t moeserve .
#   docker run -p 50051:50051 -p 9464:9464 moeserve --model tiny
# Inside the container it listens on every interface (the image asks for 0.0.0.0); reflection
# and GetExpertWeights stay off unless flags turn them on (docs/security.md).
FROM debian:bookworm AS build
WORKDIR /src
COPY scripts/setup.sh scripts/setup.sh
RUN apt-get update -qq && apt-get install -y -qq sudo python3 python3-pip >/dev/null && \
    PYTHON=python3 scripts/setup.sh
COPY . .
RUN BUILD_DIR=/build scripts/build.sh -DMOESERVE_BUILD_TESTS=OFF -DMOESERVE_BUILD_BENCHMARKS=OFF \
    -DMOESERVE_ENABLE_CUDA=OFF

FROM debian:bookworm-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libopenblas0-pthread libabsl20220623 \
      libprometheus-cpp-core1.0 libssl3 ca-certificates >/dev/null && \
    rm -rf /var/lib/apt/lists/*
COPY --from=build /build/bin/moeserve /usr/local/bin/moeserve
COPY --from=build /build/bin/moeserve-cli /usr/local/bin/moeserve-cli
USER 65534:65534
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/moeserve", "--listen", "0.0.0.0:50051", "--metrics_address", "0.0.0.0:9464"]
