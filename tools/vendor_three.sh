#!/usr/bin/env bash
# Vendor three.js (MIT) into the dashboard's static files, so the Atlas page needs no network at run
# time and the wheel carries it (pyproject package-data: static/vendor/*). Run when upgrading three:
#
#     tools/vendor_three.sh            # needs npm and the npm registry, once
#
# Pinned to 0.170.0, the last release shipping a minified single-file ES module
# (build/three.module.min.js; later ones split it in two and ship no minified build).
set -euo pipefail
VERSION=0.170.0
cd "$(dirname "$0")/.."
dest=colibri_core/server/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "three@$VERSION" >/dev/null && tar xzf "three-$VERSION.tgz")
mkdir -p "$dest"
cp "$work/package/build/three.module.min.js" "$dest/three.module.min.js"
cp "$work/package/examples/jsm/controls/OrbitControls.js" "$dest/OrbitControls.js"
cp "$work/package/LICENSE" "$dest/three-LICENSE"
echo "three.js $VERSION" > "$dest/VERSION"
echo "vendored three.js $VERSION into $dest"
