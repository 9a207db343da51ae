#!/usr/bin/env bash
# Apply fl-megatron's patch series (patches/megatron-lm/) to a Megatron-LM checkout at core_v0.16.1.
#
#   tools/apply_megatron_patch.sh MEGATRON_LM_DIR [--check]
#
# Refuses a directory that is not Megatron-LM at core_v0.16.1 (git describe when it is a git
# checkout with tags, and megatron/core/package_info.py in every case). Checks every patch
# before changing anything; patches already applied are skipped, so running it twice is fine.
# --check only reports what it would do. Exit status: 0 done (or nothing to do), 1 refused.
#
# Then it checks the Python that will run Megatron-LM ($PYTHON, default python3) for what the
# patched training needs beyond Megatron-LM itself (fl-megatron, megatron-core 0.16.1, six, einops:
# pip install -e '<fl-megatron>[megatron-lm]'), and copies the prebuilt dataset helpers of the
# installed megatron-core wheel into the checkout when it has none (else Megatron-LM builds them
# with make at start-up, which needs pybind11 and python3-config).
set -euo pipefail

TAG=core_v0.16.1
VERSION=0.16.1
PATCHES="$(cd "$(dirname "${BASH_SOURCE[0]}")/../patches/megatron-lm" && pwd)"

die() { echo "apply_megatron_patch: $*" >&2; exit 1; }

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: $0 MEGATRON_LM_DIR [--check]"
CHECK_ONLY=0
[ "${2:-}" = "--check" ] && CHECK_ONLY=1
[ $# -eq 1 ] || [ $CHECK_ONLY -eq 1 ] || die "unknown option '$2' (usage: $0 MEGATRON_LM_DIR [--check])"
[ -d "$1" ] || die "$1 is not a directory"
DIR="$(cd "$1" && pwd -P)"
for f in pretrain_gpt.py megatron/training/training.py megatron/training/arguments.py megatron/core/package_info.py; do
    [ -f "$DIR/$f" ] || die "$DIR is not a Megatron-LM checkout ($f is missing)"
done

# the version: package_info.py always, git describe when the checkout has tags
found="$(sed -n 's/^\(MAJOR\|MINOR\|PATCH\) = \([0-9]*\).*/\2/p' "$DIR/megatron/core/package_info.py" | paste -sd.)"
[ "$found" = "$VERSION" ] || die "$DIR is Megatron-LM $found (megatron/core/package_info.py); the patches are for $TAG ($VERSION)"
IS_GIT=0
if top="$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null)" && [ "$(cd "$top" && pwd -P)" = "$DIR" ]; then
    IS_GIT=1
    if described="$(git -C "$DIR" describe --tags 2>/dev/null)"; then
        case "$described" in
            "$TAG"|"$TAG"-*) ;;
            *) die "$DIR is at $described (git describe --tags), not $TAG: git -C $DIR checkout $TAG" ;;
        esac
    fi
fi

# git apply, confined to DIR (outside a git checkout it must not find an enclosing repository)
gapply() {
    if [ $IS_GIT -eq 1 ]; then
        git -C "$DIR" apply --whitespace=nowarn "$@"
    else
        GIT_CEILING_DIRECTORIES="$(dirname "$DIR")" git -C "$DIR" apply --whitespace=nowarn "$@"
    fi
}

todo=()
while read -r name; do
    [ -n "$name" ] || continue
    patch="$PATCHES/$name"
    [ -f "$patch" ] || die "$patch (listed in $PATCHES/series) is missing"
    if gapply --check --reverse "$patch" 2>/dev/null; then
        echo "already applied: $name"
    elif err="$(gapply --check "$patch" 2>&1)"; then
        todo+=("$patch")
        echo "applies cleanly: $name"
    else
        die "$name neither applies nor is applied (local changes to the files it touches?):
$err"
    fi
done < "$PATCHES/series"

REPO="$(cd "$PATCHES/../.." && pwd)"
environment() {
    local py="${PYTHON:-python3}" missing helpers
    command -v "$py" >/dev/null || { echo "environment: $py not found (set PYTHON to the one that runs Megatron-LM)"; return; }
    missing="$("$py" - <<'PY'
import importlib.util
need = {"fl_megatron": "fl-megatron", "megatron.core": "megatron-core==0.16.1", "six": "six", "einops": "einops"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod.split(".")[0]) is None
               or (mod == "megatron.core" and importlib.util.find_spec(mod) is None)))
PY
)"
    if [ -n "$missing" ]; then
        echo "environment: $py lacks $missing; install them with: $py -m pip install -e '$REPO[megatron-lm]'"
    else
        echo "environment: $py has fl-megatron, megatron-core, six and einops"
    fi
    ls "$DIR"/megatron/core/datasets/helpers_cpp*.so >/dev/null 2>&1 && return
    helpers="$("$py" -c 'import glob, os, sysconfig, megatron.core.datasets as d; print(os.path.join(os.path.dirname(d.__file__), "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX")))' 2>/dev/null || true)"
    if [ -n "$helpers" ] && [ -f "$helpers" ] && [ $CHECK_ONLY -eq 0 ]; then
        cp "$helpers" "$DIR/megatron/core/datasets/"
        echo "environment: copied megatron-core's prebuilt dataset helpers ($(basename "$helpers")) into the checkout"
    else
        echo "environment: no prebuilt dataset helpers; Megatron-LM builds them with make at start-up (pybind11 and python3-config needed)"
    fi
}

if [ ${#todo[@]} -eq 0 ]; then
    echo "nothing to do: the fl-megatron series is applied to $DIR"
    environment
    exit 0
fi
if [ $CHECK_ONLY -eq 1 ]; then
    echo "check only: ${#todo[@]} patch(es) would be applied to $DIR"
    environment
    exit 0
fi
for patch in "${todo[@]}"; do
    gapply "$patch"
done
echo "applied ${#todo[@]} patch(es) to $DIR"
environment
