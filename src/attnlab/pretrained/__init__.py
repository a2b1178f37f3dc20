"""Pretrained models from elsewhere, opened directly or converted into attnlab run directories.

* :mod:`.sources`: any model a command or ``attnlab.load`` is given (a run, a Hugging Face folder
  or cached name, a GGUF file), opened the same way;
* :mod:`.layout`: one :class:`~attnlab.pretrained.layout.Family` per ``model_type``, mapping
  config.json and Hugging Face's tensor names onto attnlab's model, and the filling of the model;
* :mod:`.checkpoint`, :mod:`.families`, :mod:`.hf_model`: Hugging Face checkpoints of the decoder
  families in :data:`attnlab.pretrained.families.FAMILIES`, read in memory from safetensors;
* :mod:`.gguf`, :mod:`.gguf_file`: Llama-family GGUF files, their tensor names renamed to Hugging
  Face's and mapped by the ``llama`` family;
* :mod:`.bert`, :mod:`.encoder_families`: BERT and RoBERTa encoders in the Hugging Face layout
  (``attnlab import bert``), the families of :data:`attnlab.pretrained.encoder_families.ENCODER_FAMILIES`.
"""

from attnlab.pretrained.bert import BertSource, ImportedBert, find_source, import_bert, package_source

__all__ = ["BertSource", "ImportedBert", "find_source", "import_bert", "package_source"]
