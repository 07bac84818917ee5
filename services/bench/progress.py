"""A progress bar for long runs: tqdm when installed (the `bench` extra), else a line per 10%."""

import sys


class _Lines:
    """Prints `label: done/total` to stderr at each tenth of the way."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done, self._next = total, label, 0, 0

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done >= self._next:
            print(f"{self.label}: {self.done}/{self.total}", file=sys.stderr, flush=True)
            self._next = self.done + max(1, self.total // 10)

    def close(self) -> None:
        pass


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, label: str, disabled: bool = False):
    """An object with `update(n=1)` and `close()`."""
    if disabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, label)
    return tqdm(total=total, desc=label, file=sys.stderr, unit="req")
