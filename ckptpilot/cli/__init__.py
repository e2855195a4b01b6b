"""The ``ckptpilot`` command, on top of everything else: nothing below imports it
(``tests/test_layout.py`` lists the one module that still does, and why).

``command.py`` owns the parser and the dispatch (:func:`main`, the console script and
``python -m ckptpilot``); the subcommands it runs from here: ``ops.py`` (``ls``, ``recover``,
``prune``, ``validate``), ``report.py`` (``report``: goodput from the run's own records) and
``demo.py`` (``demo``, the main job). ``peer``, ``simulate`` and ``fit`` live with what they
run (``tiers/peer/command.py``, ``simulate/``, ``fit/``). Importing this package loads no
torch, so a peer daemon's process stays without it.
"""

from ckptpilot.cli.command import build_parser, main

__all__ = ["build_parser", "main"]
