# Sourced by scripts/gpu-bench.sh and scripts/gpu-experiments.sh: compile caches (inductor's kernels,
# vLLM's compile cache) carried to the GPU machine and written back. A cache goes to $OUT as pieces
# NAME.tgz.00, NAME.tgz.01, ... of at most 15 MiB, since a file coming back from that machine may
# have 16 MiB (inductor's grew past that once both attention modes were compiled); it is read from
# .gpu-carry/ or /tmp/parts/ (where the carry parts are moved) as such pieces or as one NAME.tgz.

unpack_cache() {  # NAME DIR
    local name=$1 dir=$2 where
    mkdir -p "$dir"
    for where in .gpu-carry /tmp/parts; do
        if [ -f "$where/$name.tgz" ]; then tar xzf "$where/$name.tgz" -C "$dir"; fi
        if compgen -G "$where/$name.tgz.[0-9]*" > /dev/null; then
            cat "$where/$name.tgz".[0-9]* | tar xz -C "$dir"
        fi
    done
}

pack_cache() {  # NAME DIR
    local name=$1 dir=$2
    rm -f "$OUT/$name.tgz".[0-9]*
    tar cz -C "$dir" . | split -b 15M -d - "$OUT/$name.tgz." && ls -l "$OUT/$name.tgz".[0-9]*
}
