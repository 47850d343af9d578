"""ClozeMath: fine-tune LLMs for math reasoning with equation infilling (Pham et al. 2025)."""

from clozemath.errors import ClozeMathError

__all__ = ["ClozeMathError"]
