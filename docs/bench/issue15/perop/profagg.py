"""Sums a py-spy raw profile (`record --format raw`) over the event loop's stacks while it
runs (not the set-up): self time by leaf frame and inclusive time by function, as shares.
Usage: profagg.py PROFILE"""

import collections
import re
import sys

SETUP = ("Engine.__init__", "start_target", "_find_and_load", "aclose", "register (")


def frame(f: str) -> str:
    """A frame without its file and line (Python) or its address (native)."""
    return re.sub(r" \(.*?:\d+\)$", "", f) if ".py:" in f else re.sub(r"^0x[0-9a-f]+ ", "", f)


def main(path: str) -> None:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as fh:
        for line in fh:
            stack, _, n = line.rstrip().rpartition(" ")
            if "run_forever" not in stack or any(x in stack for x in SETUP):
                continue
            frames = [frame(f) for f in stack.split(";")]
            total += int(n)
            own[frames[-1]] += int(n)
            for f in set(frames):
                incl[f] += int(n)
    print(f"{path}: {total} samples of the running loop")
    for title, c, k in (("self", own, 25), ("inclusive", incl, 40)):
        print(f"-- {title}")
        for f, n in c.most_common(k):
            print(f"{100 * n / max(total, 1):5.1f}% {f[:100]}")


if __name__ == "__main__":
    main(sys.argv[1])
