"""Summarise a py-spy raw profile: ``python profile_summary.py RAW [FRAME]``. With FRAME, the
stacks through it: inclusive and self shares per function (line numbers dropped); without,
the samples per thread."""

import collections
import re
import sys

SKIP = ("Thread._bootstrap", "Thread.run", "_worker (concurrent")


def main(path: str, focus: str | None) -> None:
    incl: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    roots: collections.Counter = collections.Counter()
    total = 0
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2:
            continue
        fr = [re.sub(r":\d+\)", ")", f) for f in frames[1:]]  # (the first names the thread)
        roots[(frames[0][:60], next((f for f in fr if not f.startswith(SKIP)), "?"))] += int(n)
        if focus and not any(focus in f for f in fr):
            continue
        total += int(n)
        for f in set(fr):
            incl[f] += int(n)
        own[fr[-1] if fr else "?"] += int(n)
    if not focus:
        for (thread, root), n in roots.most_common(25):
            print(f"{n:6d} {thread} {root}")
        return
    print("total", total)
    for f, n in incl.most_common(45):
        print(f"{100 * n / total:5.1f}% {f}")
    print("--- self")
    for f, n in own.most_common(25):
        print(f"{100 * n / total:5.1f}% {f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
