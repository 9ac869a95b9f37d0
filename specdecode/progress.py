"""rich's progress bar, made to reach a log too.

Where the console is not a terminal (`nohup specdecode train data ... > log`, CI), rich draws nothing until the work
ends, so hours of data generation would leave an empty log. This bar prints its line there at most once every
`log_every` seconds; on a terminal it is rich's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.progress import Progress as RichProgress


class Progress(RichProgress):
    def __init__(self, *columns, log_every: float = 60.0, clock: Callable[[], float] = time.monotonic, **kwargs):
        super().__init__(*columns, **kwargs)
        self.log_every = log_every
        self._clock = clock
        self._logged = clock()

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._log()

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log()

    def _log(self) -> None:
        if self.disable or self.console.is_terminal:
            return
        now = self._clock()
        if now - self._logged >= self.log_every:
            self._logged = now
            self.console.print(self.make_tasks_table(self.tasks))
