#!/usr/bin/env bash
# Prints a PYTHONPATH entry under which `import tandem` is this checkout without installing it
# (a temporary folder holding a `tandem` link to the repository root); for the device scripts.
ns=$(mktemp -d /tmp/tandem-ns.XXXXXX)
ln -s "$(cd "$(dirname "$0")/.." && pwd)" "$ns/tandem"
echo "$ns"
