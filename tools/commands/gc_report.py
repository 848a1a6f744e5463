"""What `kvstore gc` prints about segment compaction (kvstore/gc.py): the plan's
mostly-dead segments and retired files, then what was compacted and freed."""

from __future__ import annotations

from tools.commands.common import human_bytes


def gc_compaction_plan_line(summary: dict) -> str:
    """summary: GCPlan.summary()."""
    return (f"plan: {summary['compact_segments']} mostly-dead segment(s) to compact "
            f"({human_bytes(summary['compact_live_nbytes'])} live of "
            f"{human_bytes(summary['compact_tail_nbytes'])}), "
            f"{summary['retired_segments']} retired segment file(s) awaiting removal")


def gc_compaction_done_line(deleted: dict) -> str:
    """deleted: GCPlan.execute()'s result at schema 2."""
    line = (f"compacted {deleted['compacted_segments']} segment(s): relocated "
            f"{deleted['relocated_records']:,} live records "
            f"({human_bytes(deleted['relocated_nbytes'])}); removed "
            f"{deleted['removed_segments']} retired segment file(s), freeing "
            f"{human_bytes(deleted['removed_nbytes'])}; punched "
            f"{deleted['punched_records']:,} dead records "
            f"({human_bytes(deleted['punched_nbytes'])})")
    if deleted["compaction_quarantined"]:
        line += (f"; [yellow]{deleted['compaction_quarantined']} damaged record(s) "
                 "quarantined instead of copied[/yellow]")
    return line
