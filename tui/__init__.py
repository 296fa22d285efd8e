"""The Textual chat: ``liubai chat``.

``app.py`` (the App and ``run_chat``) · ``screens/`` (the chat, help and stats screens, each with
its ``.tcss``) · ``widgets/`` (one widget per module: the chat log and its parts, the KV gauge,
the pool panel, the latency panel, the turn map) · ``messages.py`` (how the agent's events reach
the widgets from the worker thread) · ``commands.py`` (slash commands and their parser) ·
``command_palette.py`` (the palette's provider) · ``export.py`` (``/export``) · ``totals.py``
(``/stats``' sums). ``tui`` imports ``agent``, ``memory`` and ``runtime``; none of them imports
``tui`` (but the CLI's one late import).
"""
