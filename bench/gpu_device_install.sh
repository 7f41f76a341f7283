#!/usr/bin/env bash
# streamrl GPU kit installer, run on the lent GPU machine from the repo root, once per `run` call:
#   carry: [".whl/cNN", ".whl/device_install.sh", ".whl/MANIFEST.txt"]   (one carry folder per call)
#   command: bash .whl/device_install.sh        (or: bash .whl/cNN/device_install.sh; each carry holds a copy)
# Each call copies the carry folders it finds (.whl/c[0-9][0-9]) into $KIT (/tmp/kit, which outlives the
# call while the machine stays warm: make the calls back to back, it goes back after 30 s idle). Once every
# carry of MANIFEST.txt is in $KIT it rebuilds the split wheels, checks every wheel's sha256 and installs
# them all into $SITE (/tmp/site). Idempotent: carries already copied and an install already done are skipped.
# Exit: 0 installed (or already installed); 10 carries still missing (expected on all but the last call);
# 1 error (bad size/checksum, pip failed).
# Env overrides (for testing): WHL=.whl KIT=/tmp/kit SITE=/tmp/site PY=python3 DRY=1 (everything but pip).
set -u -o pipefail
WHL=${WHL:-.whl}
KIT=${KIT:-/tmp/kit}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
DRY=${DRY:-0}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "[kit] $*"; }
die() { echo "[kit] ERROR: $*" >&2; exit 1; }

mkdir -p "$KIT" || die "cannot create $KIT"
MAN=""
for m in "$WHL/MANIFEST.txt" "$here/MANIFEST.txt" "$KIT/MANIFEST.txt"; do
    [ -f "$m" ] && { MAN=$m; break; }
done
[ -n "$MAN" ] || die "no MANIFEST.txt (looked in $WHL, $here, $KIT): carry .whl/MANIFEST.txt"
if [ -f "$KIT/MANIFEST.txt" ] && [ "$MAN" != "$KIT/MANIFEST.txt" ] && ! cmp -s "$MAN" "$KIT/MANIFEST.txt"; then
    die "$MAN differs from $KIT/MANIFEST.txt (a kit of another build is in $KIT: rm -rf $KIT, or use a new KIT)"
fi
[ "$MAN" = "$KIT/MANIFEST.txt" ] || cp -f "$MAN" "$KIT/MANIFEST.txt"
MAN=$KIT/MANIFEST.txt
mansum=$(sha256sum "$MAN" | cut -c1-16)

fsize() { stat -c %s "$1" 2>/dev/null || echo -1; }

# 1. copy whatever carry folders travelled with this call
copied=0
for d in "$WHL"/c[0-9][0-9]; do
    [ -d "$d" ] || continue
    c=$(basename "$d")
    grep -q "^carry $c " "$MAN" || die "$d is not a carry of $MAN"
    before=$copied
    while read -r _ fc name size sum; do
        [ "$fc" = "$c" ] || continue
        src=$d/$name; dst=$KIT/$name
        if [ "$(fsize "$dst")" = "$size" ]; then continue; fi
        [ "$(fsize "$src")" = "$size" ] || die "$src missing or of the wrong size (want $size bytes)"
        got=$(sha256sum "$src" | cut -d' ' -f1)
        [ "$got" = "$sum" ] || die "$src: sha256 $got, want $sum"
        cp -f "$src" "$dst.tmp" && mv -f "$dst.tmp" "$dst" || die "copy of $src failed"
        copied=$((copied + 1))
    done < <(grep '^file ' "$MAN")
    say "carry $c: $((copied - before)) file(s) copied into $KIT (the rest were there already)"
done
say "$copied file(s) copied this call"

# 2. which carries are complete in $KIT
present=(); missing=()
while read -r _ c _; do
    ok=1
    while read -r _ fc name size _; do
        [ "$fc" = "$c" ] || continue
        [ "$(fsize "$KIT/$name")" = "$size" ] || { ok=0; break; }
    done < <(grep '^file ' "$MAN")
    if [ $ok = 1 ]; then present+=("$c"); else missing+=("$c"); fi
done < <(grep '^carry ' "$MAN")
ntot=$(( ${#present[@]} + ${#missing[@]} ))
say "carries present in $KIT: ${#present[@]}/$ntot (${present[*]:-none})"
if [ ${#missing[@]} -gt 0 ]; then
    say "carries MISSING: ${#missing[@]}/$ntot (${missing[*]}): carry them next (each call: .whl/cNN plus this script and MANIFEST.txt)"
    exit 10
fi

# 3. rebuild split wheels, check every wheel
while read -r _ w size sum npieces _; do
    [ "$npieces" -gt 0 ] || continue
    if [ "$(fsize "$KIT/$w")" = "$size" ]; then continue; fi
    parts=$(awk -v w="$w" '$1 == "piece" && $2 == w {print $3, $4}' "$MAN" | sort -n | awk -v k="$KIT" '{print k "/" $2}')
    [ "$(echo "$parts" | wc -l)" = "$npieces" ] || die "$w: MANIFEST lists the wrong number of pieces"
    # shellcheck disable=SC2086
    cat $parts > "$KIT/$w.tmp" && mv -f "$KIT/$w.tmp" "$KIT/$w" || die "reassembly of $w failed"
    say "reassembled $w from $npieces pieces"
done < <(grep '^wheel ' "$MAN")
awk '$1 == "wheel" {print $4 "  " $2}' "$MAN" > "$KIT/SHA256SUMS"
nwheels=$(wc -l < "$KIT/SHA256SUMS")
if ! (cd "$KIT" && sha256sum --quiet -c SHA256SUMS); then
    die "sha256 check failed (above); delete the bad file(s) from $KIT and carry its carry again"
fi
say "all $nwheels wheels present and their sha256 match"
extra=$(comm -13 <(awk '{print $2}' "$KIT/SHA256SUMS" | sort) <(cd "$KIT" && ls -1 -- *.whl | sort))
[ -z "$extra" ] || die "wheels in $KIT that MANIFEST does not list (two versions would break the install): $extra"

# 4. install (once)
stamp=$SITE/.streamrl-kit-$mansum
if [ -f "$stamp" ]; then
    say "already installed into $SITE (stamp $(basename "$stamp")): skipping pip"
elif [ "$DRY" = 1 ]; then
    say "DRY=1: would run: $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $KIT/*.whl"
else
    t0=$(date +%s)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/*.whl \
        || die "pip install failed"
    mkdir -p "$SITE" && touch "$stamp" || die "cannot write $stamp"
    say "installed $nwheels wheels into $SITE in $(( $(date +%s) - t0 )) s"
fi

# 5. how to use it (also as a file to source)
cat > "$KIT/env.sh" <<EOF
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0
EOF
say "now, in the same command (or every later call while the machine stays warm):"
say "    export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0"
say "  or: . $KIT/env.sh"
if [ "$DRY" != 1 ]; then
    # versions python3 sees with the kit first: the kit's own and the image's that vLLM/Ray pin or bound
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" - <<'EOF' || true
import importlib.metadata as m
names = ["vllm", "ray", "transformers", "pydantic", "pydantic-core", "typing-extensions", "gguf", "mcp",
         "torch", "triton", "numpy", "numba", "huggingface-hub", "tokenizers", "safetensors", "requests", "pillow",
         "aiohttp", "protobuf", "setuptools", "opencv-python-headless", "anyio", "click", "grpcio", "regex",
         "tiktoken", "sentencepiece", "msgpack", "filelock", "six"]
out = []
for n in names:
    try:
        out.append(f"{n}={m.version(n)}")
    except m.PackageNotFoundError:
        out.append(f"{n}=MISSING")
print("[kit] versions: " + " ".join(out))
print("[kit] vLLM 0.32.0 asks (ignored by --no-deps): torch==2.13.0 torchvision==0.28.0 torchaudio==2.11.0 numba==0.65.0 "
      "requests>=2.33 pillow>=12.3 aiohttp>=3.14.3 (ray: >=3.14.4) opencv-python-headless>=4.13 setuptools<81 "
      "huggingface_hub>=1.31 tokenizers>=0.23.2 safetensors>=0.6.2 protobuf>=5.29.6 (not 6.30-6.33.4); "
      "mistral-common: numpy<2.4; anyio>=4.10 (httpx2)")
EOF
fi
exit 0
