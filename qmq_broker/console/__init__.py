"""The operator's console: a web page the broker serves at ``/console`` (docs/console.md).

``history`` (a bounded ring of samples), ``recent_consumers`` (consumers heard from lately),
``disk`` (the data directory's disk use) and ``sampler`` (the loop that fills the history)
are core code and know nothing of HTTP; ``service`` turns them and the broker's read-only
views into the console's JSON answers (``answers``: their models, for the OpenAPI
document); ``http`` serves the page's files (``static/``: plain ES modules, no build step).
"""
