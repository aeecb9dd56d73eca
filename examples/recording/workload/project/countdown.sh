#!/bin/sh
# Counts down from $1 (default 3), one line at a time.
n=${1:-3}
while [ "$n" -gt 0 ]; do
    echo "$n..."
    n=$((n - 1))
    sleep 0.3
done
echo "liftoff"
