"""Tools for checkpoints at rest: read one tensor or a slice, inspect, verify, export to
safetensors, convert from/to DCP and Hugging Face folders, edit, copy one generation on its own. The ``bcp`` command
(``bcp.cli``) is a thin layer over these functions. See ``docs/tools.md``."""

from bcp.tools.checkpoint import Checkpoint, open_checkpoint, read_tensor
from bcp.tools.convert_dcp import DcpConvertResult, convert_bcp_to_dcp, convert_dcp_to_bcp
from bcp.tools.convert_hf import HfConvertResult, convert_hf_to_bcp
from bcp.tools.edit import EditResult, copy_checkpoint, edit_checkpoint, remove_entries
from bcp.tools.export import ExportResult, export_safetensors
from bcp.tools.report import Report, report
from bcp.tools.progress import NoProgress, Progress, TerminalProgress, progress_for
from bcp.tools.rules import CastRules, NameRules
from bcp.tools.summary import format_summary, summarize
from bcp.tools.verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "Checkpoint", "open_checkpoint", "read_tensor",
    "summarize", "format_summary",
    "verify_checkpoint", "VerifyReport", "Problem",
    "export_safetensors", "ExportResult",
    "convert_hf_to_bcp", "HfConvertResult", "convert_dcp_to_bcp", "convert_bcp_to_dcp", "DcpConvertResult",
    "edit_checkpoint", "copy_checkpoint", "remove_entries", "EditResult",
    "NameRules", "CastRules",
    "report", "Report",
    "Progress", "NoProgress", "TerminalProgress", "progress_for",
]
