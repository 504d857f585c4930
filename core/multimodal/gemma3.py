"""Gemma 3's image family: the checkpoint's Gemma3 image processor resizes an image to one frame of
the tower's size ([1, 3, S, S]; pan-and-scan off, transformers' default); the chat template writes
`<start_of_image>` per image, and it expands into the processor's `full_image_sequence`:
"\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n",
tokenized; the soft tokens take the encoder's rows.

transformers' processor writes that text into the prompt and tokenizes the whole, so the "\\n\\n" at
each end merges with newlines beside it: Gemma's vocabulary has one token per run of newlines, and
its chat template puts "\\n" before an image that opens a turn ("user\\n" + "\\n\\n" is one "\\n\\n\\n"
token), and two images side by side meet as "\\n\\n\\n\\n". The engine expands an already tokenized
prompt, so `joined` tokenizes each run of newline tokens that crosses an image's edge again, as
one text, which gives the ids transformers' processor gives (vLLM merges the same pairs).
Registered in families.py (FAMILIES)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .family import Expansion, ImageFamily, load_pair_tokenizer
from .inputs import ImageSpan

_LONGEST_RUN = 32  # newline runs looked up in the vocabulary (Gemma's has one token for up to 31)


class Gemma3Family(ImageFamily):
    """Gemma 3 (Gemma3ForConditionalGeneration): one frame per image, no tiles (`split` is
    ignored), mm_tokens_per_image soft tokens between <start_of_image> and <end_of_image>."""

    def __init__(self, processor: Any, image_token_id: int):
        super().__init__(processor)
        tokenizer = processor.tokenizer
        self.placeholder = processor.boi_token
        self.placeholder_id = tokenizer.convert_tokens_to_ids(processor.boi_token)
        self.image_token_id = image_token_id
        tokens = tuple(tokenizer.encode(processor.full_image_sequence, add_special_tokens=False))
        self.expansion = Expansion(tokens, tuple(i for i, t in enumerate(tokens) if t == image_token_id))
        # token id -> how many newlines it is, for the tokens that are a run of newlines alone
        self.newline_runs: dict[int, int] = {}
        for count in range(1, _LONGEST_RUN + 1):
            ids = tokenizer.encode("\n" * count, add_special_tokens=False)
            if len(ids) == 1:
                self.newline_runs.setdefault(ids[0], count)

    @classmethod
    def processor_from_config(cls, processor_config: dict[str, Any], tokenizer_files: tuple[str, str | None]) -> Any:
        """transformers' Gemma3Processor with the PIL Gemma3 image processor (BILINEAR resizing to
        the tower's size, as llama.cpp's clip.cpp), over the GGUF's tokenizer given the image
        tokens the processor reads from it (a GGUF's tokenizer has them as plain added tokens)."""
        from transformers import Gemma3Processor

        try:  # transformers 5: the PIL image processor has its own class
            from transformers.models.gemma3.image_processing_pil_gemma3 import \
                Gemma3ImageProcessorPil as ImageProcessor
        except ImportError:  # transformers 4: Gemma3ImageProcessor is the PIL one
            from transformers import Gemma3ImageProcessor as ImageProcessor

        tokens = {key: processor_config[key] for key in ("boi_token", "eoi_token", "image_token")}
        tokenizer = load_pair_tokenizer(tokenizer_files, extra_special_tokens=tokens)
        return Gemma3Processor(ImageProcessor(**processor_config["image_processor"]), tokenizer,
                               image_seq_length=processor_config["image_seq_length"])

    def prepare(self, image: Any, split: bool) -> tuple[Any, Expansion]:
        return self.frames(image, split), self.expansion

    def frames(self, image: Any, split: bool) -> Any:
        return self.processor.image_processor(images=[image], do_pan_and_scan=False,
                                              return_tensors="pt")["pixel_values"]

    def joined(self, tokens: list[int], spans: list[ImageSpan]) -> tuple[list[int], list[ImageSpan]]:
        """Each run of newline tokens that crosses an image's edge, tokenized again as one text
        (the ids transformers' processor gives); a merged token belongs to the later image whose
        run it is part of, else to the image it touches (spans stay contiguous, their soft tokens
        untouched)."""
        edges = {s.offset for s in spans} | {s.end for s in spans}
        owner: list[int | None] = [None] * len(tokens)
        for index, span in enumerate(spans):
            owner[span.offset:span.end] = [index] * span.length
        out: list[int] = []
        out_owner: list[int | None] = []
        moved: dict[int, int] = {}  # old position -> new, of every token kept as it was
        start = 0
        while start < len(tokens):
            stop = start + 1
            if tokens[start] in self.newline_runs:
                while stop < len(tokens) and tokens[stop] in self.newline_runs:
                    stop += 1
            if stop - start > 1 and any(start < edge < stop for edge in edges):
                count = sum(self.newline_runs[t] for t in tokens[start:stop])
                merged = self.processor.tokenizer.encode("\n" * count, add_special_tokens=False)
                owners = [o for o in owner[start:stop] if o is not None]
                out.extend(merged)
                out_owner.extend([max(owners)] * len(merged))
            else:
                for position in range(start, stop):
                    moved[position] = len(out)
                    out.append(tokens[position])
                    out_owner.append(owner[position])
            start = stop
        return out, [self._moved(index, span, out_owner, moved) for index, span in enumerate(spans)]

    @staticmethod
    def _moved(index: int, span: ImageSpan, owner: list[int | None], moved: dict[int, int]) -> ImageSpan:
        positions = [p for p, o in enumerate(owner) if o == index]
        offset = positions[0]
        return replace(span, offset=offset, length=len(positions),
                       embed_offsets=tuple(moved[span.offset + r] - offset for r in span.embed_offsets))
