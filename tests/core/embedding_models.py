"""Tiny random-weight embedding models, built offline, with their sentence-transformers files:
a Qwen3 / Qwen2 decoder (Qwen3-Embedding and gte-Qwen2 shapes) and BERT / XLM-RoBERTa
encoders (all-MiniLM, multilingual-e5 shapes), each with a tokenizer trained here on a few
sentences (a byte-level BPE that appends its end-of-text token as Qwen3-Embedding's does, a
WordPiece with [CLS] ... [SEP] as BERT's). No chat template: sentence-transformers would
render one around each text. The references are sentence-transformers' own `encode`."""
from __future__ import annotations

import numpy as np
import torch

from model_helpers import randomize

CORPUS = ["the quick brown fox jumps over the lazy dog", "embeddings map text to vectors",
          "Switchyard serves language models on the CPU", "pooling reduces hidden states to one vector",
          "hello world", "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
          "Matryoshka embeddings can be cut to fewer dimensions", "ünïcödé tèxt, and punctuation!?"]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a",
         "pooling reduces hidden states to one vector " * 6, "ünïcödé"]


def bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE whose post-processor appends <|endoftext|> (Qwen3-Embedding's tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                             special_tokens=[("<|endoftext|>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def wordpiece_tokenizer(vocab_size: int = 300):
    """A lower-casing WordPiece with BERT's [CLS] $A [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return BertTokenizerFast(tokenizer_object=tokenizer)


def decoder_config(model_type: str, vocab_size: int, **extra):
    from transformers import Qwen2Config, Qwen3Config

    kind = {"qwen3": Qwen3Config, "qwen2": Qwen2Config}[model_type]
    return kind(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                tie_word_embeddings=True, **extra)


def encoder_config(model_type: str, vocab_size: int, **extra):
    from transformers import BertConfig, XLMRobertaConfig

    kind = {"bert": BertConfig, "xlm-roberta": XLMRobertaConfig}[model_type]
    options = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=128, **extra)
    if model_type == "xlm-roberta":
        options.update(pad_token_id=0, type_vocab_size=1, max_position_embeddings=130)
    return kind(**options)


def save_embedding_model(path, config, tokenizer, pooling_mode: str | None, normalize: bool = True, seed: int = 3):
    """A randomized transformers base model of `config` saved at `path` with `tokenizer`, and, when
    `pooling_mode` is given ("lasttoken", "mean", "cls"), saved again through sentence-transformers
    with its Pooling (and Normalize) modules. Returns the path."""
    from transformers import AutoModel

    hf = AutoModel.from_config(config, dtype=torch.float32).eval()
    randomize(hf, seed)
    return save_sentence_transformer(path, hf, tokenizer, pooling_mode, normalize)


def save_sentence_transformer(path, hf_base_model, tokenizer, pooling_mode: str | None, normalize: bool = True):
    """`hf_base_model` (a transformers base model: Qwen2Model, BertModel, ...) and `tokenizer` saved at
    `path`, then, with `pooling_mode`, through sentence-transformers with Pooling (and Normalize)."""
    hf_base_model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if pooling_mode is None:
        return str(path)
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    modules = [Transformer(str(path)), Pooling(hf_base_model.config.hidden_size, pooling_mode=pooling_mode)]
    SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(path))
    return str(path)


def reference_embeddings(path, texts=TEXTS, **encode_options) -> np.ndarray:
    """sentence-transformers' embeddings of `texts`, float32 [len(texts), dim]."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(list(texts), convert_to_numpy=True, batch_size=4, **encode_options).astype(np.float32)


def assert_close(ours, reference, cosine: float = 0.9999, atol: float = 1e-4) -> None:
    """Each row's cosine similarity above `cosine` and the largest absolute difference below `atol`."""
    ours, reference = np.asarray(ours, dtype=np.float32), np.asarray(reference, dtype=np.float32)
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    cosines = (ours * reference).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(reference, axis=-1)
    assert cosines.min() > cosine, cosines
    assert np.abs(ours - reference).max() < atol, np.abs(ours - reference).max()
