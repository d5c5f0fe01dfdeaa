"""The sentence-transformers files a Qwen3-VL-Embedding checkpoint carries beside the
transformers ones: modules.json (a feature-extraction Transformer over the whole folder, then
1_Pooling, then 2_Normalize), 1_Pooling/config.json (last-token pooling), 2_Normalize/config.json,
sentence_bert_config.json (the Transformer: every modality through forward's last_hidden_state,
messages in the structured chat format, rendered with the generation prompt) and
config_sentence_transformers.json (cosine similarity). The key names are those sentence-transformers
6 writes. What a server reads from them: the pooling (last token) and the normalisation."""

from __future__ import annotations

# Each modality the Transformer module takes, and the chat-message form of them all at once.
_FORWARD = {"method": "forward", "method_output_name": "last_hidden_state"}
MODALITY_CONFIG = {
    "text": _FORWARD,
    "image": _FORWARD,
    "video": _FORWARD,
    "message": {**_FORWARD, "format": "structured"},
}


def sentence_transformers_files(hidden_size: int) -> dict[str, object]:
    """File path (relative to the checkpoint) -> JSON content, for embeddings of `hidden_size`."""
    return {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize",
            },
        ],
        "sentence_bert_config.json": {
            "transformer_task": "feature-extraction",
            "modality_config": MODALITY_CONFIG,
            "module_output_name": "token_embeddings",
            "processing_kwargs": {"chat_template": {"add_generation_prompt": True}},
        },
        "1_Pooling/config.json": {
            "embedding_dimension": hidden_size,
            "pooling_mode": "lasttoken",
            "include_prompt": True,
        },
        "2_Normalize/config.json": {
            "module_input_name": "sentence_embedding",
            "module_output_name": "sentence_embedding",
        },
        "config_sentence_transformers.json": {
            "model_type": "SentenceTransformer",
            "prompts": {"query": "", "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    }
