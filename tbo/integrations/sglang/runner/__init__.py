"""The engine on an SGLang ModelRunner, built in undoable steps (`engine`), the layer loop that replaces the model's
(`loop`) and the observer that enters each microbatch's forward context (`contexts`)."""
