"""How many tokens to guess next: more after guesses that all held, fewer after misses.

A miss wastes the rows after it, so the next guess is only one longer than what was accepted;
a fully accepted guess doubles, up to the request's most (``num_draft_tokens``).
"""


class DraftLength:
    def __init__(self, most: int) -> None:
        self.most = most
        self.current = most

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_accepted == num_drafted:
            self.current = min(self.most, max(self.current, 2 * num_drafted))
        else:
            self.current = max(1, num_accepted + 1)
