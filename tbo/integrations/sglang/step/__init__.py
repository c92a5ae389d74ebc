"""One SGLang forward step: the split decision (tbo's `SplitPolicy`, static or adaptive) and the microbatches'
ForwardBatches, built by SGLang's own `TboForwardBatchPreparer.filter_batch`."""
