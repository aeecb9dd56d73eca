#!/bin/sh
# Serves page.html, with the marker given as $1 written into it, on port 8080 (the declared
# endpoint `web`). busybox httpd returns once it listens and keeps serving in the background.
marker=${1:-}
case $marker in
    '' | *[!a-z0-9-]*)
        echo "usage: ./serve.sh MARKER (lowercase letters, digits and '-')" >&2
        exit 2 ;;
esac
mkdir -p /tmp/site
sed "s/@MARKER@/$marker/" page.html >/tmp/site/index.html
httpd -p 8080 -h /tmp/site && echo "serving /tmp/site on port 8080"
