#!/usr/bin/env bash
# Write the commit under test into the tree, as .gpu-check-commit, for
# scripts/gpu-check.sh on a machine that gets the tree without .git (the device
# tool's copy): line 1 the commit, line 2 when it was written and whether the
# tree had uncommitted changes. The file is ignored by git: pass it in the
# device tool's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse HEAD)
state=clean
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then state="with uncommitted changes"; fi
printf '%s\nwritten %s, tree %s\n' "$commit" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$state" >.gpu-check-commit
cat .gpu-check-commit
