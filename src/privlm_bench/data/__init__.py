"""The bench's data: named tasks over the product's corpora (:mod:`privlm.data`) and table files (GLUE, your
CSV/TSV/JSONL). The product's loaders are re-exported, so a sweep imports its data from one place."""

from privlm.data import *  # noqa: F403 - the product's loaders, by their own __all__
from privlm.data import __all__ as _product_names
from privlm_bench.data.tables import GLUE_TASKS, load_glue, load_table
from privlm_bench.data.tasks import TASK_NAMES, named_task

__all__ = [*_product_names, "GLUE_TASKS", "TASK_NAMES", "load_glue", "load_table", "named_task"]
