"""Whether each source of a composite pays on the request being decoded (`drafters.composite`).

A source is worth asking while the tokens it adds are worth more than its drafting costs. Per step it is
asked, it *gains* the tokens of its own proposal that verification would have accepted beyond the most that
any source asked before it accepted (the sources are asked cheapest first, so a later one is judged on what
it adds to the cheaper ones), and it *costs* the seconds its proposal took, in plain steps (the target's
one-token forward on the cost curve): an accepted token saves about one plain step. In a batch every sequence of a step
waits for each one's drafting, so there the seconds are priced at the batch's pace instead, its seconds a token
(`Drafter.batch_pace`). Both are decayed sums
over the steps it was asked, kept per request (what pays depends on the text more than on anything learnt
from earlier requests), starting from a prior of `PRIOR_GAIN` tokens so that one unlucky first step does
not bench a source.

After at least `EVIDENCE` steps asked, a source whose gain is below its cost is *benched*: not asked
until the text changes character, or until its rest is over (`FIRST_REST` steps, doubling while it keeps
failing up to `LAST_REST`), whichever comes first; then it is on trial again, its ledger fresh. The text's
character is the band of accepted tokens per step of the whole composite (decayed): nothing copied or
guessed, a few tokens, long runs (`BANDS`); a step that moves it to another band puts every benched source
back on trial (with every source benched nothing is drafted, so the character stays "nothing copied" and only a
rest's end brings a source back: up to `LAST_REST` steps on text that turned copy-heavy meanwhile, for a source
that costs enough for its rest to double; a near-free one's rest stays `FIRST_REST`, its trials paying at once). A
benched source still hears every verdict (`Drafter.observe`): heads keep their features
current and copy sources their index, so it drafts at once when it is back. Which sources are asked never
changes the output: the verifier decides that.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

EVIDENCE = 4  # steps a source is asked before it can be benched
FIRST_REST, LAST_REST = 16, 128  # steps a benched source sits out, doubling while it keeps failing
DECAY = 0.85  # weight of a source's earlier steps in its ledger, per step it is asked
PRIOR_GAIN = 1.0  # tokens a source is credited with before it has drafted (decays like the rest)
BANDS = (0.5, 2.0)  # accepted tokens per step where the text's character changes (see the docstring)
CHARACTER_DECAY = 0.8  # weight of earlier steps in the composite's accepted tokens per step


@dataclass
class Ledger:
    """One source's decayed gain and cost on this request, and whether it is benched."""

    gain: float = PRIOR_GAIN
    cost: float = 0.0
    asked: int = 0  # steps asked since its trial began
    benched_until: int | None = None  # the step it is back (None: asked)
    rest: int = FIRST_REST  # steps its next benching lasts

    def trial(self) -> None:
        self.gain, self.cost, self.asked, self.benched_until = PRIOR_GAIN, 0.0, 0, None


def gains(accepted: list[int | None]) -> list[float | None]:
    """Per source in the order asked, its accepted tokens beyond the most accepted by the sources before it
    (None: not asked). [3, None, 5, 1] -> [3, None, 2, 0]"""
    best, out = 0, list[float | None]()
    for count in accepted:
        if count is None:
            out.append(None)
            continue
        out.append(float(max(count - best, 0)))
        best = max(best, count)
    return out


def band(tokens_per_step: float) -> int:
    """The text's character: the band of accepted tokens per step it falls in (`BANDS`)."""
    return bisect.bisect_right(BANDS, tokens_per_step)


class Payoff:
    """The ledgers of a composite's sources on the current request (see the module docstring)."""

    def __init__(self, sources: int):
        self.ledgers = [Ledger() for _ in range(sources)]
        self.begin()

    def begin(self) -> None:
        """A new request: every source asked, its ledger fresh."""
        for ledger in self.ledgers:
            ledger.trial()
            ledger.rest = FIRST_REST
        self.step = 0
        self.accepted = 0.0  # decayed accepted tokens per step of the composite
        self.weight = 0.0
        self.character: int | None = None

    def asks(self, source: int) -> bool:
        """Whether the source is asked at this step."""
        until = self.ledgers[source].benched_until
        return until is None or self.step >= until

    def record(self, accepted: list[int | None], costs: list[float], verified: int) -> None:
        """A step: each source's accepted tokens as its proposal alone would have had them (None: not
        asked), the plain steps each one's proposal cost, and the tokens verification accepted."""
        for ledger, gain, cost in zip(self.ledgers, gains(accepted), costs):
            if ledger.benched_until is not None and self.step >= ledger.benched_until:
                ledger.trial()  # its rest is over
            if gain is None:
                continue
            ledger.gain = DECAY * ledger.gain + gain
            ledger.cost = DECAY * ledger.cost + cost
            ledger.asked += 1
            if ledger.asked >= EVIDENCE and ledger.gain < ledger.cost:
                ledger.benched_until = self.step + 1 + ledger.rest
                ledger.rest = min(2 * ledger.rest, LAST_REST)
            elif ledger.asked >= EVIDENCE:
                ledger.rest = FIRST_REST
        self.accepted = CHARACTER_DECAY * self.accepted + verified
        self.weight = CHARACTER_DECAY * self.weight + 1
        character = band(self.accepted / self.weight)
        if self.character is not None and character != self.character:
            for ledger in self.ledgers:  # the text changed character: every benched source back on trial
                if ledger.benched_until is not None:
                    ledger.trial()
        self.character = character
        self.step += 1

    def benched(self) -> list[int]:
        """The sources not asked at the next step."""
        return [i for i in range(len(self.ledgers)) if not self.asks(i)]
