"""Low-level helpers shared by ``data``, ``training``, ``cli`` and ``bench``: atomic file writes
(:mod:`lintime.utils.io`) and device / precision choice (:mod:`lintime.utils.device`).  They
import nothing from the rest of lintime."""
