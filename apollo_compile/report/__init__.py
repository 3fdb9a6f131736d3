"""What apollo decided, shown to a person: the report, the dumps, the logs, the command line.

- :mod:`.explain`: :func:`~apollo_compile.explain` and :class:`Report` (text, HTML, trace);
- :mod:`.model`: the report's data; :mod:`.stats`: the numbers it shows;
- :mod:`.text`, :mod:`.html_page`, :mod:`.svg`, :mod:`.trace`: its renderings;
- :mod:`.dump`: a graph's annotated listing, JSON and DOT (the ``*.apollo.txt`` dumps);
- :mod:`.logs`: apollo in ``TORCH_LOGS``, ``TORCH_TRACE`` and ``TORCH_COMPILE_DEBUG``;
- :mod:`.cli`: ``python -m apollo_compile report``.

The package imports none of its modules: the planner (:mod:`apollo_compile.plan`,
:mod:`apollo_compile.pipeline`) writes dumps and logs through :mod:`.dump` and :mod:`.logs`
without loading the report, which reads the plans. ``apollo_compile.explain`` and
``apollo_compile.Report`` are the public names.
"""
