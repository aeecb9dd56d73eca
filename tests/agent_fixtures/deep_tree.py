"""A directory tree nested LEVELS deep below DIR, a file at its bottom (issue 26): `make DIR LEVELS` builds it,
`check DIR` prints how deep it goes and what the bottom file holds. One directory fd at a time, so the paths may
outgrow PATH_MAX; run by the tests on the host and, mounted at /opt/fake, inside session containers."""

import os
import sys

FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def make(top: str, levels: int) -> None:
    fd = os.open(top, FLAGS)
    for _ in range(levels):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", FLAGS, dir_fd=fd)
        os.close(fd)
        fd = below
    with open(os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as bottom:
        bottom.write("at the bottom")
    os.close(fd)


def check(top: str) -> str:
    fd, levels = os.open(top, FLAGS), 0
    while "d" in os.listdir(fd):
        below = os.open("d", FLAGS, dir_fd=fd)
        os.close(fd)
        fd, levels = below, levels + 1
    with open(os.open("bottom.txt", os.O_RDONLY, dir_fd=fd)) as bottom:
        return f"{levels} {bottom.read()}"


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], int(sys.argv[3]))
    else:
        print(check(sys.argv[2]))
