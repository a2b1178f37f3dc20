"""Pretrained checkpoints from elsewhere, converted into attnlab run directories.

* :mod:`.bert`: BERT-family encoders in the Hugging Face layout (``attnlab import bert``).
"""

from attnlab.pretrained.bert import BertSource, ImportedBert, find_source, import_bert, package_source

__all__ = ["BertSource", "ImportedBert", "find_source", "import_bert", "package_source"]
