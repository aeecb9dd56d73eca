#!/bin/sh
# Copies into this example's controller build context the one file it takes from Reploy:
# reploy_driver.py, the small controller library. Run it once before `reploy.py stage`:
#
#   ./prepare.sh [REPLOY_CHECKOUT]     (default: the checkout this folder sits in, ../..)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
reploy=${1:-$here/../..}
driver=$reploy/examples/controller/context/reploy_driver.py
if [ ! -f "$driver" ]; then
    echo "prepare.sh: $driver not found; pass the path of a Reploy checkout" >&2
    exit 2
fi
cp "$driver" "$here/controller/reploy_driver.py"
echo "prepare.sh: copied reploy_driver.py into $here/controller/" >&2
