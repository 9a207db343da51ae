#!/usr/bin/env bash
# Builds .gpu-carry/: the wheels a GPU machine without network needs on top of its image, for
#   bash tools/gpu_check.sh --install    (pip install --no-index --find-links .gpu-carry, per extra)
# (the device tool: run(carry=[".gpu-carry"], ...); `make gpu-bundle` runs this script).
# The image: CPython 3.12 on Linux x86-64 (glibc modern enough for manylinux_2_28) with torch 2.11
# (CUDA), transformers, safetensors, sentencepiece 0.2.2, tokenizers, numpy, packaging, psutil,
# py-cpuinfo, msgpack, nvidia-ml-py, einops, ninja, tqdm, requests, ... but no deepspeed,
# megatron-core, torchft, hjson, pydantic(-core), annotated-types, typing-inspection,
# opentelemetry-*, googleapis-common-protos, and maybe a protobuf older than our floor.
#
# What it carries (versions pinned below), for cp312 manylinux / pure-Python wheels only:
#   fl-megatron itself (built from this tree; the script fails without it)
#   deepspeed 0.19.8 (PyPI has only its sdist: built here with DS_BUILD_OPS=0, a py3-none-any
#     wheel whose ops are compiled JIT at run time) + hjson, pydantic, pydantic-core,
#     annotated-types, typing-inspection, typing-extensions
#   megatron-core 0.16.1 (cp312 wheel) + packaging (it needs >= 24.2)
#   torchft 0.2.0 (cp312 wheel) + opentelemetry api/sdk/otlp-http exporter and what they pull
#   protobuf >= 7.36.1 and sentencepiece 0.2.3 (setup.py's floors: the image's sentencepiece 0.2.2
#     ties 16 tokenizations that 0.2.3 and our tokenizer.json agree on, tests/test_sentencepiece_fast.py)
# A wheel that cannot be had for Python 3.12 is reported (which one and why) and left out; the
# GPU checks that need it then cannot install the extra that names it. Without
#   deepspeed (or its deps)    -> the deepspeed backend check ("deepspeed bf16 step, ...") skips
#   megatron-core              -> the megatron backend check ("megatron bf16 step, ...") skips
#   torchft (or opentelemetry) -> the elastic checks ("elastic, 2 groups' jobs on NCCL") skip
#   protobuf >= 7.36.1         -> nothing installs (fl-megatron's base requirement): say so loudly
# gpu_check.sh --install installs each extra on its own, so one missing wheel costs only its checks.
#
# Building deepspeed wants setuptools + wheel and (preferably) torch importable: .venv/bin/python
# if it has them, else python3 if it has them, else a throw-away venv (python3 -m venv) with
# setuptools, wheel and torch==2.13.0+cpu (a local wheel via pip's find-links); without a CPU
# torch wheel to be had it builds without torch (the wheel is the same pure-Python one; deepspeed's own sdist
# records torch 0.0). Environment: PYTHON (the pip that downloads; default python3),
# GPU_BUNDLE_BUILD_PYTHON (force the building python), GPU_BUNDLE_MAX_MIB (default 60).
# The bundle is built in a temporary folder and moved to .gpu-carry/ only when complete.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
MAX_MIB=${GPU_BUNDLE_MAX_MIB:-60}
DEST=.gpu-carry

DEEPSPEED=deepspeed==0.19.8
# extra -> pinned wheels (pydantic 2.14.4 pins pydantic-core==2.50.5 and wants typing-extensions>=4.16,
# typing-inspection>=0.4.4; opentelemetry-sdk 1.45.2 pins semantic-conventions 0.66b2 and the otlp-http
# exporter pins proto/common 1.45.2 plus the 0.66b2 http-transport and otlp-common packages)
DEEPSPEED_DEPS=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
                typing-inspection==0.4.5 typing-extensions==4.16.0)
MEGATRON=(megatron-core==0.16.1 packaging==26.4)
ELASTIC=(torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
         opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
         opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2
         opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
         googleapis-common-protos==1.76.0)
BASE=(protobuf==7.36.2 sentencepiece==0.2.3)

PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform any)

start=$(date +%s)
STAGE=$(mktemp -d "$PWD/.gpu-carry.tmp.XXXXXX")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle.XXXXXX")
LOG="$WORK/pip.log"
had_build=0; [ -e build ] && had_build=1
had_egg=0; [ -e fl_megatron.egg-info ] && had_egg=1
cleanup() {
    rm -rf "$STAGE" "$WORK"
    # pip builds this tree in place: drop what it left if it was not here before
    [ "$had_build" = 1 ] || rm -rf build
    [ "$had_egg" = 1 ] || rm -rf fl_megatron.egg-info
}
trap cleanup EXIT

MISSING=()   # "name: why (effect)"

# pip's output goes to $LOG; on failure its last lines are shown (minus this machine's noise about
# absent local index folders)
show_log() { grep -v 'is ignored: it is neither a file nor a directory' "$LOG" | tail -n "${1:-8}" | cut -c1-300 | sed 's/^/      /'; }

newest() { ls -t "$STAGE"/$1 2>/dev/null | head -n 1 || true; }

size_of() { du -h "$1" | cut -f1; }

# download NAME==VERSION "what lacks it": one line per package
download() {
    local spec=$1 effect=$2 name version file
    name=${spec%%==*}; version=${spec#*==}
    if "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$STAGE" "$spec" >"$LOG" 2>&1; then
        file=$(newest "$(echo "$name" | tr - _ | tr '[:upper:]' '[:lower:]')-$version-*.whl")
        [ -n "$file" ] || file=$(newest "*-$version-*.whl")
        echo "  ok       $spec  ($(basename "${file:-?}"), $(size_of "${file:-/dev/null}"))"
    else
        echo "  MISSING  $spec: no wheel for CPython 3.12 manylinux x86-64 could be downloaded; $effect"
        show_log
        MISSING+=("$spec: download failed ($effect)")
    fi
}

has_build_tools() {  # $1: python; setuptools with bdist_wheel (wheel, or setuptools >= 70.1)
    "$1" - <<'EOF' >/dev/null 2>&1
import setuptools
try:
    import wheel  # noqa: F401
except ImportError:
    import setuptools.command.bdist_wheel  # noqa: F401
EOF
}

has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }

pick_build_python() {
    if [ -n "${GPU_BUNDLE_BUILD_PYTHON:-}" ]; then echo "$GPU_BUNDLE_BUILD_PYTHON"; return; fi
    local candidate
    for candidate in .venv/bin/python "$PY"; do
        if [ -x "$candidate" ] || command -v "$candidate" >/dev/null 2>&1; then
            if has_torch "$candidate" && has_build_tools "$candidate"; then echo "$candidate"; return; fi
        fi
    done
    echo ""
}

echo "gpu_bundle: building $DEST/ for CPython 3.12, manylinux x86-64 (pip: $("$PY" -m pip --version | cut -d' ' -f1-2))"

# --- the building python --------------------------------------------------------------------------
BPY=$(pick_build_python)
if [ -z "$BPY" ]; then
    echo "  build venv: no python with torch + setuptools + wheel; making one in $WORK/venv"
    "$PY" -m venv "$WORK/venv" >"$LOG" 2>&1 || { echo "  ERROR: $PY -m venv failed"; show_log; exit 1; }
    BPY="$WORK/venv/bin/python"
    if ! "$BPY" -m pip install -q 'setuptools>=70.1' wheel >"$LOG" 2>&1; then
        echo "  ERROR: could not install setuptools + wheel into the build venv"; show_log; exit 1
    fi
    # the CPU build only (a local wheel through pip's find-links, or the PyTorch CPU index where
    # reachable): PyPI's torch==2.13.0 is a CUDA build of gigabytes
    if "$BPY" -m pip install -q 'torch==2.13.0+cpu' >"$LOG" 2>&1; then
        echo "  build venv: torch $("$BPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
    else
        echo "  build venv: no torch==2.13.0+cpu wheel to be had; deepspeed builds without torch (the same pure wheel)"
    fi
fi
echo "  building with $BPY (torch: $("$BPY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none))"

# --- fl-megatron --------------------------------------------------------------------------------
if "$BPY" -m pip wheel -q --no-deps --no-build-isolation -w "$STAGE" . >"$LOG" 2>&1 \
        && file=$(newest 'fl_megatron-*-py3-none-any.whl') && [ -n "$file" ]; then
    echo "  ok       fl-megatron  ($(basename "$file"), $(size_of "$file"))"
else
    echo "  ERROR: fl-megatron's own wheel failed to build:"; show_log 20
    exit 1
fi

# --- deepspeed (sdist only on PyPI) ---------------------------------------------------------------
ds_ok=0
if DS_BUILD_OPS=0 "$BPY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation -w "$WORK/ds" "$DEEPSPEED" >"$LOG" 2>&1; then
    file=$(ls "$WORK"/ds/deepspeed-*.whl 2>/dev/null | head -n 1)
    case "$(basename "${file:-none}")" in
        deepspeed-*-py3-none-any.whl)
            # pure Python: it must also compile under Python 3.12 when one is at hand
            py312=""
            for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
                if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
                    py312=$candidate; break
                fi
            done
            if [ -n "$py312" ] && ! "$py312" - "$file" >"$LOG" 2>&1 <<'EOF'
import sys, zipfile
bad = []
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.endswith(".py"):
            try:
                compile(z.read(n), n, "exec")
            except SyntaxError as e:
                bad.append(f"{n}: {e}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
EOF
            then
                echo "  MISSING  $DEEPSPEED: its wheel does not compile under Python 3.12; the deepspeed backend check skips"
                show_log; MISSING+=("$DEEPSPEED: not valid Python 3.12 (deepspeed backend check skips)")
            else
                mv "$file" "$STAGE/"; ds_ok=1
                echo "  ok       $DEEPSPEED  ($(basename "$file"), $(size_of "$STAGE/$(basename "$file")"), built, DS_BUILD_OPS=0${py312:+, compiles on $("$py312" -V 2>&1)})"
            fi ;;
        *)
            echo "  MISSING  $DEEPSPEED: the build gave $(basename "${file:-nothing}"), not a py3-none-any wheel usable on CPython 3.12; the deepspeed backend check skips"
            MISSING+=("$DEEPSPEED: not a pure wheel (deepspeed backend check skips)") ;;
    esac
else
    echo "  MISSING  $DEEPSPEED: building its wheel from the sdist failed; the deepspeed backend check skips"
    show_log; MISSING+=("$DEEPSPEED: build failed (deepspeed backend check skips)")
fi
if [ "$ds_ok" = 1 ]; then
    for spec in "${DEEPSPEED_DEPS[@]}"; do download "$spec" "deepspeed cannot install: the deepspeed backend check skips"; done
fi

# --- megatron-core, torchft, base --------------------------------------------------------------
for spec in "${MEGATRON[@]}"; do download "$spec" "megatron-core cannot install: the megatron backend check skips"; done
for spec in "${ELASTIC[@]}"; do download "$spec" "torchft cannot install: the elastic checks skip"; done
for spec in "${BASE[@]}"; do
    download "$spec" "fl-megatron's base requirement cannot be met unless the image has it"
done

# --- summary -------------------------------------------------------------------------------------
echo "gpu_bundle: wheels"
(cd "$STAGE" && du -h -- *.whl | sort -k2 | sed 's/^/  /')
kib=$(du -sk "$STAGE" | cut -f1)
echo "gpu_bundle: total $(du -sh "$STAGE" | cut -f1) ($(ls "$STAGE"/*.whl | wc -l) wheels), built in $(( $(date +%s) - start )) s"
if [ "$kib" -gt $(( MAX_MIB * 1024 )) ]; then
    echo "ERROR: the bundle is over ${MAX_MIB} MiB (what a device command may carry is 64 MiB in all)"; exit 1
fi

rm -rf "$DEST"
mv "$STAGE" "$DEST"
echo "gpu_bundle: wrote $DEST/"
if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "gpu_bundle: LEFT OUT ${#MISSING[@]} wheel(s):"
    printf '  %s\n' "${MISSING[@]}"
fi
