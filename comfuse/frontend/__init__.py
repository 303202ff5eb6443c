"""Frontend (owns: capturing a PyTorch program as an aten graph, and finding the GEMM +
epilogue regions in it, lowered to the IR).

Invariants: capture computes nothing (fake tensors); every region's IR passes the
verifier; contracting a region to one node leaves the graph acyclic.
"""
from .capture import CaptureError, capture
from .regions import Candidate, find_regions

__all__ = ["Candidate", "CaptureError", "capture", "find_regions"]
