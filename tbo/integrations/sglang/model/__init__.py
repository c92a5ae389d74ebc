"""An SGLang model as tbo sees it: which layers it has and where their pieces are (`structure`), and each decoder
layer as the ops tbo's strategies name (`layers`)."""
