#!/usr/bin/env bash
# The packaging check (`make check-dist`, run by .ci/run): build the sdist and wheel of colibri and
# of every plugin under plugins/ with `python -m build` (each wheel built from its sdist), install
# the wheels, never -e, into a fresh venv outside the checkout, and use them from there as a user
# would: colibri --version, colibri run on the bundled demo model, colibri plugins --json, colibri
# install WHEEL | DIR | NAME, colibri uninstall, an unknown name's one-line error, colibri pull of a tiny
# model from a hub on localhost (tests/hubserver.py) then colibri run --model ORG/NAME, and every
# plugin's own tests (its conformance suite) run against the installed wheels. The built files stay in dist/.
#
# A new plugins/NAME/ is covered once git tracks its pyproject.toml (and plugins.py names it: the
# shipped-plugin table `colibri install NAME` reads). PYTHON: the interpreter that builds and makes
# the venv (default: .venv's). KEEP=1 keeps the scratch directory.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
DIST=$ROOT/dist
WORK=$(mktemp -d "${TMPDIR:-/tmp}/colibri-check-dist.XXXXXX")
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { printf '\n== [%3ds] %s\n' $((SECONDS - START)) "$*"; }
fail() { echo "check-dist: FAIL: $*" >&2; exit 1; }
# pip -q, without the warning pip repeats for every package an extra index configured here lacks
pipq() { pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

cd "$ROOT"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t PLUGINS < <(git ls-files 'plugins/*/pyproject.toml' | xargs -n1 dirname)
else
    mapfile -t PLUGINS < <(ls -d plugins/*/pyproject.toml | xargs -n1 dirname)
fi
[ ${#PLUGINS[@]} -gt 0 ] || fail "no plugins under plugins/"

step "build: colibri and ${#PLUGINS[@]} plugins (${PLUGINS[*]})"
mkdir -p "$DIST"
rm -f "$DIST"/colibri-*.tar.gz "$DIST"/colibri-*.whl "$DIST"/colibri_*.tar.gz "$DIST"/colibri_*.whl
for src in . "${PLUGINS[@]}"; do
    "$PYTHON" -m build --outdir "$DIST" "$src" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; fail "python -m build $src"; }
    tail -n 1 "$WORK/build.log"
done
CORE_WHEEL=$(ls "$DIST"/colibri-*.whl)

step "what the wheels carry"
"$PYTHON" - "$DIST" "${PLUGINS[@]}" <<'EOF'
import email.parser, sys, tomllib, zipfile
from pathlib import Path
dist, plugins = Path(sys.argv[1]), sys.argv[2:]
(core,) = dist.glob("colibri-*.whl")
names = zipfile.ZipFile(core).namelist()
need = ["colibri_core/kernels/_colibri_kernels.abi3.so", "colibri_core/server/static/index.html",
        "colibri_core/demo/colibri-demo-kjv/colibri.yaml", "colibri_core/demo/colibri-demo-kjv/experts/layer-000.bin"]
missing = [n for n in need if n not in names]
stray = [n for n in names if ".coli_usage" in n or ".sessions/" in n or n.startswith(("tests/", "plugins/", "csrc/"))]
assert not missing and not stray, f"{core.name}: missing {missing}, should not carry {stray}"
print(f"{core.name}: {len(names)} files, {core.stat().st_size / 1e6:.1f} MB (kernels, dashboard, demo model)")
for where in plugins:
    project = tomllib.loads(Path(where, "pyproject.toml").read_text())["project"]
    (wheel,) = dist.glob(f"{project['name'].replace('-', '_')}-{project['version']}-*.whl")
    z = zipfile.ZipFile(wheel)
    (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [r for r in email.parser.Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
                if r.replace(" ", "").startswith("colibri") and r.replace(" ", "")[7:8] in "<>=!~"]
    assert requires, f"{wheel.name}: declares no range of colibri versions (dependencies: colibri>=…,<…)"
    print(f"{wheel.name}: requires {requires[0]}")
EOF

step "fresh venv, no checkout on the path: pip install dist/colibri-*.whl dist/colibri_olmoe-*.whl"
"$PYTHON" -m venv "$WORK/venv"
export PATH="$WORK/venv/bin:$PATH" PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH VIRTUAL_ENV COLIBRI_MODEL COLIBRI_LOAD_PLUGINS
cd "$WORK"
pipq install -q "$CORE_WHEEL" "$DIST"/colibri_olmoe-*.whl
python -c "import colibri_core, sys; assert colibri_core.__file__.startswith(sys.prefix), colibri_core.__file__"
colibri --version

step 'colibri run --max-tokens 40 "And God said"'
colibri run --max-tokens 40 "And God said" >run.out 2>run.err || { cat run.err; fail "colibri run"; }
cat run.out run.err
grep -q '[A-Za-z]' run.out && grep -q 'tok/s.*expert hit rate.*peak RSS' run.err || fail "colibri run: no text or no stats line"
DEMO=$(python -c "from colibri_core.demo import demo_model; print(demo_model())")
[ -z "$(ls -A "$DEMO" | grep -v -x -e colibri.yaml -e config.json -e generation_config.json -e resident.safetensors \
        -e tokenizer.json -e tokenizer_config.json -e experts)" ] || fail "colibri run wrote beside the installed demo model: $(ls -A "$DEMO")"

listed() { colibri plugins --json | python -c "import json, sys; print(' '.join(sorted(p['name'] for p in json.load(sys.stdin) if p['loaded'])))"; }
expect() { local got; got=$(listed); [ "$got" = "$1" ] || fail "colibri plugins lists '$got', expected '$1'"; echo "colibri plugins: $got"; }

step "colibri pull tiny/olmoe from a hub on localhost (tests/hubserver.py), then colibri run --model tiny/olmoe"
mkdir tiny
python - tiny <<'PY'
import sys
from colibri_olmoe.demo import write_checkpoint, write_tokenizer
eos = write_tokenizer(sys.argv[1], ["the quick brown fox jumps over the lazy dog " * 20], 300)
write_checkpoint(sys.argv[1], vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_experts=8, num_experts_per_tok=2, eos_token_id=eos)
PY
python "$ROOT/tests/hubserver.py" hub tiny/olmoe tiny >hub.url &
HUB_PID=$!
for _ in $(seq 100); do [ -s hub.url ] && break; sleep 0.1; done
[ -s hub.url ] || { kill "$HUB_PID"; fail "the local hub server did not start"; }
hub() { env HF_ENDPOINT="$(cat hub.url)" HF_HOME="$WORK/hf" COLIBRI_HOME="$WORK/colibri" HF_HUB_DISABLE_PROGRESS_BARS=1 "$@"; }
hub colibri pull tiny/olmoe >pull.log 2>&1 || { kill "$HUB_PID"; cat pull.log; fail "colibri pull tiny/olmoe"; }
tail -n 2 pull.log
hub colibri run --model tiny/olmoe --max-tokens 4 "hi" >run.out 2>run.err || { kill "$HUB_PID"; cat run.err; fail "colibri run --model tiny/olmoe"; }
kill "$HUB_PID"
cat run.out
grep -q 'tok/s' run.err || fail "colibri run --model tiny/olmoe: no stats line"
hub colibri list

step "colibri plugins --json"
colibri plugins --json
expect "colibri colibri-olmoe"

step "colibri install: a wheel, a directory, by name; colibri uninstall; an unknown name"
colibri install "$(ls "$DIST"/colibri_glm52-*.whl)" >install.log 2>&1 || { cat install.log; fail "colibri install WHEEL"; }
expect "colibri colibri-glm52 colibri-olmoe"
colibri uninstall glm52 >install.log 2>&1 || { cat install.log; fail "colibri uninstall glm52"; }
expect "colibri colibri-olmoe"
colibri install "$ROOT/plugins/glm52" >install.log 2>&1 || { cat install.log; fail "colibri install DIR"; }
expect "colibri colibri-glm52 colibri-olmoe"
export PIP_FIND_LINKS="$DIST${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}"  # pip's own setting: where NAME is found
want="colibri colibri-glm52 colibri-olmoe"
for where in "${PLUGINS[@]}"; do
    name=$(python -c "import tomllib, sys; print(tomllib.load(open(sys.argv[1], 'rb'))['project']['name'])" "$ROOT/$where/pyproject.toml")
    case " $want " in *" $name "*) continue ;; esac
    colibri install "$name" >install.log 2>&1 || { cat install.log; fail "colibri install $name"; }
    want=$(echo "$want $name" | tr ' ' '\n' | sort | tr '\n' ' ' | sed 's/ $//')
    expect "$want"
done
if colibri install colibri-nope 2>err.log; then fail "colibri install colibri-nope succeeded"; fi
[ "$(wc -l <err.log)" = 1 ] && grep -q "unknown plugin 'colibri-nope': colibri ships" err.log || { cat err.log; fail "unknown name: not one line"; }
cat err.log
colibri plugins
colibri --version

step "the plugins' tests (the conformance kit) against the installed wheels"
pipq install -q "$CORE_WHEEL[test]"  # pytest and the oracle, pinned as colibri's test extra pins them
mkdir suites
for where in "${PLUGINS[@]}"; do cp -r "$ROOT/$where/tests" "suites/$(basename "$where")"; done
python -m pytest -q -p no:cacheprovider --rootdir "$WORK/suites" suites

step "check-dist: PASS"
