#!/usr/bin/env bash
# Cut the vLLM parts in .gpu-carry/ (part_NN, from the project's GPU notes' build) again, into pieces
# that each fit a GPU call beside the working tree: a call carries at most 64 MiB with the tree, and
# the build's 60 MiB pieces beside a tree of 10.5 MiB did not. The pieces are one xz stream cut in
# order, so scripts/gpu-env.sh unpacks them as before.
#   scripts/gpu-parts.sh [MiB per call, default 64]
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-64}
compgen -G ".gpu-carry/part_[0-9]*" > /dev/null || { echo "no .gpu-carry/part_NN: build the vLLM parts first" >&2; exit 1; }
# What travels with every call: tracked files and untracked ones git does not ignore.
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- | tail -1 | cut -f1)
size=$(( (limit << 20) - tree - (2 << 20) ))  # 2 MiB to spare
[ "$size" -gt $((8 << 20)) ] || { echo "the working tree ($tree bytes) leaves no room for a part" >&2; exit 1; }
joined=$(mktemp)
cat .gpu-carry/part_[0-9]* > "$joined"
rm .gpu-carry/part_[0-9]*
split -b "$size" -d "$joined" .gpu-carry/part_
rm "$joined"
ls -l .gpu-carry/part_*
echo "each part beside the working tree ($((tree >> 20)) MiB) fits one call of $limit MiB"
