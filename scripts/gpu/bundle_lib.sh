# Sourced by the device scripts. unpack_bundle BUNDLE.tgz unpacks a bundle made with
# `tar -C DIR -czf BUNDLE.tgz NAME` (NAME/bin: stripped binaries; NAME/lib: the shared libraries
# that /work/shared/tools/bundle-libs.sh collected for them) into /tmp/sa, then sets D (the
# bundle's folder), B (its bin/) and LD_LIBRARY_PATH (its lib/). With SA_READY set (a script
# called by another that unpacked already) the unpacked copy is reused.
unpack_bundle() {
  if [ -z "${SA_READY:-}" ]; then
    rm -rf /tmp/sa && mkdir -p /tmp/sa && tar -C /tmp/sa -xzf "$1" || return 1
  fi
  D=$(ls -d /tmp/sa/*/ | head -1)
  B=${D}bin
  export LD_LIBRARY_PATH=${D}lib
}
