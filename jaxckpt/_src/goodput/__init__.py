"""Goodput: a run's log analysed (``report``) and drawn (``plot``); docs/GOODPUT.md."""

from .report import Goodput as Goodput
from .report import goodput as goodput
