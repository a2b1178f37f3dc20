"""Pretrained models from elsewhere, opened directly or converted into attnlab run directories.

* :mod:`.sources`: any model a command or ``attnlab.load`` is given (a run, a Hugging Face folder
  or cached name, a GGUF file), opened the same way;
* :mod:`.checkpoint`, :mod:`.families`, :mod:`.hf_model`: Hugging Face checkpoints of the decoder
  families in :data:`attnlab.pretrained.families.FAMILIES`, read in memory from safetensors;
* :mod:`.gguf`, :mod:`.llama`: Llama-family GGUF files;
* :mod:`.bert`: BERT-family encoders in the Hugging Face layout (``attnlab import bert``).
"""

from attnlab.pretrained.bert import BertSource, ImportedBert, find_source, import_bert, package_source

__all__ = ["BertSource", "ImportedBert", "find_source", "import_bert", "package_source"]
