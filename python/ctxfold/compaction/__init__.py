"""Compaction as a core without I/O, and its parts.

- :mod:`~ctxfold.compaction.policy`: when to compact (trigger lines, low water, tail budget, reply reserve).
- :mod:`~ctxfold.compaction.view`: the view and its bookkeeping (originals, origins, unseen, turns).
- :mod:`~ctxfold.compaction.archive_pass`, :mod:`~ctxfold.compaction.summary_pass`,
  :mod:`~ctxfold.compaction.guard`: the passes; :mod:`~ctxfold.compaction.rebuild`: what they write.
- :mod:`~ctxfold.compaction.effects`: what the passes ask of the world (a summary) and the drivers,
  synchronous and asyncio, that do it.
- :mod:`~ctxfold.compaction.events`: the records of what a compaction did.

:class:`ctxfold.compaction.compactor.Compactor` holds a conversation's state and is the public face of all of it.
"""
