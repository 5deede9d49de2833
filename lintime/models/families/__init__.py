"""Built-in mixer families, one module per family (``<name>.py`` registers the family ``<name>``).

:func:`lintime.models.registry.get_family` imports a family's module the first time its name is
asked for, so adding a family is adding a file here -- see :mod:`lintime.models.registry` and
``docs/models.md``.  This package imports nothing itself.
"""
