#!/bin/sh
echo "hello from $(hostname), running as $(id -u):$(id -g) in $(pwd)"
