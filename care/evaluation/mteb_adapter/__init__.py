"""mteb 2.x on this project's models, benchmarks, C-MTEB tasks and Nano datasets, offline.

    MtebEncoder(encoder)              any care.encoders.Encoder as an mteb model (EncoderProtocol)
    benchmark_tasks(benchmark)        a project benchmark's tasks (cmedteb_open by default) as local mteb tasks
    cmteb_task(name, path=None)       a C-MTEB task: mteb's own (data from the hub), or a local copy of it
    mteb_task(task_data, name, spec)  any loaded project task (care.data.tasks.TaskData) as a local mteb task
    evaluate_tasks(encoder, tasks)    mteb.evaluate -> {task: {map_at_10, ndcg_at_10, cosine_pearson, ...}}
    compare(encoder, tasks)           mteb's main score per task beside evaluate.py's own number, and the difference
    nano_task(folder, split)          one split of a Nano folder (docs/nano.md s.10) as an mteb retrieval task
    run_mteb(encoder, folder)         mteb.evaluate on every split -> {split: {ndcg_at_10, recall_at_100, ...}}
    load_results(folder)              mteb's own loader (ResultCache.load_results) on a results folder

    python -m care.evaluation.mteb_adapter ...   the command line (cli.py: benchmark=, tasks= or nano= runs;
                                                 mteb's results into results=<dir>, default <outputs>/mteb)

The package, one concern a module (each module's docstring says what it holds):

    model.py    import_mteb (the MTEB_CACHE redirect), the similarity, ModelMeta, MtebEncoder, mteb_evaluate
    results.py  mteb's results folder: results_dir, model_folder, load_results, meta_fields
    nano.py     Nano splits as mteb tasks: mteb's loader or in memory, nano_task, run_mteb
    scores.py   the names: project task types <-> mteb's, project metrics <-> mteb scores, default_spec
    data.py     mteb's data as the project's TaskData: hub tasks, local copies, task_data, care_spec
    tasks.py    project benchmarks and C-MTEB tasks as local mteb tasks: mteb_task, benchmark_tasks, cmteb_task
    run.py      evaluate_tasks, project_scores, compare, print_comparison
    cli.py      the command line: main, main_nano, evaluate_config, encoder_from_config

What mteb needs, and how it is given (mteb 2.26.24):
- A model is anything with `encode(DataLoader, *, task_metadata, hf_split, hf_subset, prompt_type, **kw)`,
  `similarity`, `similarity_pairwise` and `mteb_model_meta` (mteb.models.models_protocols.EncoderProtocol).
  The ModelMeta is built here (`loader=None`, name `care/<model>`, revision = the encoder's fingerprint), so
  mteb never resolves the model by name nor asks the hub for it.
- mteb's prompt type picks the side: `document` -> `encode_documents`, `query` and None (symmetric tasks:
  STS, clustering) -> `encode_queries`, as evaluate.py embeds both STS sides as queries.  The project task type
  (its instruction, for an instruction prompt) comes from the mteb task type (TASK_TYPES), or per task name or
  type from `task_types=`.  mteb's own task prompts are not used: each encoder applies its configured prompts.
- Scores: `similarity="auto"` is cosine, except for encoders whose dense vectors are not unit length by design
  (CARE's document prefix, a truncated or unnormalised dense model), which get the dot product that
  evaluate.py's EncoderScorer uses.  For unit vectors the two are the same number.
- Project tasks (mteb_task, benchmark_tasks): filled in memory from the TaskData evaluate.py loads
  (care.evaluation.corpora.load_benchmarks), so mteb scores exactly the queries, documents and grades
  evaluate.py scores.  Reranking is AbsTaskRetrieval of type Reranking with `top_ranked` = each query's
  candidates and the graded judgements as relevant_docs (negatives 0); retrieval is the whole corpus; STS is
  AbsTaskSTS (columns sentence1, sentence2, score; min_score/max_score only rescale the gold, which no
  correlation sees).  The main score is the counterpart of the task's primary metric: map_at_10 (= trec's
  map_cut_10, divided by all relevant), ndcg_at_10 (graded gains), cosine_pearson.  Metadata (type, main
  score, eval split, cmn-Hans, dataset path = the task file and revision = a digest of its content, never
  resolved) is on a class per task.
- STS: mteb's `pearson`/`spearman` correlate the model's own similarity (similarity_pairwise), its
  `cosine_pearson`/`cosine_spearman` the cosine; evaluate.py's are of the cosine (the mean of both directions,
  the same number for one dense vector per text), so the cosine ones are its counterparts.  C-MTEB's STS main
  score is cosine_spearman, CMedTEB's Pearson.
- C-MTEB tasks: `cmteb_task(name)` is mteb.get_task (a name, or the hub dataset it reads), loaded as mteb
  loads it (hub or datasets cache; HF_HUB_OFFLINE=1 makes that fail, said plainly by load_hub_task); the
  project's number is then computed on mteb's data read the project's way (task_data: title + text joined as
  mteb does; reranking lists with no positive or no negative dropped and counted).  `cmteb_task(name, path)`
  reads a local copy (mteb's parquet layout through care.data.nano's pyarrow reader, or the project's layouts
  through care.data.tasks) into a local task with the same name, type and main score.
- Data: `nano_task(..., source="memory")` (default) fills `task.dataset` from care.data.nano.load_split, with
  in-memory `datasets.Dataset`s: it reads any Nano folder (NanoCMTEB's hub layout too) and writes nothing.
  `source="loader"` reads the folder's `mteb` subset (configs mteb-corpus, mteb-queries, mteb-qrels,
  mteb-top_ranked, written by data_pipeline/nano/layout.py) with mteb's stock RetrievalDatasetLoader; the
  `datasets` cache it needs is a temporary folder, deleted once the rows are copied to memory.
- Results: evaluate_tasks, compare and run_mteb (`results=<folder>`) and the command line (always, unless
  `results=none`) hand mteb.evaluate `cache=mteb.ResultCache(<folder>)`: mteb itself writes
  `<folder>/results/<org__name>/<revision>/<Task>.json` and `model_meta.json` (results.py), readable by
  `mteb.ResultCache(<folder>).load_results()` and mteb's leaderboard; overwrite_strategy "always", so a rerun
  replaces a task's file rather than handing back a stored score.  The ModelMeta (model.model_meta) says what
  the model is: CARE is model_type ["router", "dense"] (a query tower online, a document tower offline, one
  dense vector each), n_parameters both towers, n_embedding_parameters both towers' token embeddings,
  n_active_parameters the query tower's non-embedding weights (the online count, encoder.online_parameters,
  is that plus the query tower's token embeddings); any other encoder is ["dense"] with its own counts
  (mteb's active = total - embeddings).  embed_dim is the dense width, similarity_fn_name cosine or dot as
  scored; license and training_datasets are the caller's (or the model config's `license`,
  `training_datasets` keys), None (not stated) otherwise.
- Caching: `mteb.evaluate(..., cache=None)` saves no results (the in-memory runs: compare, evaluate_tasks
  and run_mteb without `results=`).  `import mteb` itself creates its result-cache
  folder (`ResultCache()` at import time, `$MTEB_CACHE` or ~/.cache/mteb): import_mteb (model.py) points
  MTEB_CACHE at the project cache (`<cache>/mteb`) unless it is set, before it imports mteb.
- Texts: mteb strips a document's outer whitespace (and joins a title before it); the project's readers strip
  every text already, so the two embed the same strings.
- Reranking (`reranking=True`): the task carries `top_ranked` = the `reranking_hybrid` lists, and mteb scores
  exactly those candidates (type "Reranking", queries embedded for the project's `retrieval` task as
  evaluate.py's `<split>_hybrid` view does); a positive the list lacks counts as missed in both.
- Ties: mteb hands trec_eval the raw float32 scores (ties then go by doc id, descending), as evaluate.py's
  retrieval view does; its candidate views hand it ranks after a seeded shuffle, so there an exact tie keeps
  the shuffled order.  Scores computed by torch (mteb) and faiss/numpy (evaluate.py) may also differ in the
  last float32 bit, so only a model whose scores have no (near-)ties gives the very same rankings.
"""
from __future__ import annotations

from care.evaluation.mteb_adapter.cli import USAGE, encoder_from_config, evaluate_config, main, main_nano
from care.evaluation.mteb_adapter.data import (
    LOCAL_LAYOUTS,
    care_spec,
    load_hub_task,
    load_local_copy,
    mteb_document_text,
    read_parquet_copy,
    retrieval_data,
    task_data,
)
from care.evaluation.mteb_adapter.model import (
    LANGUAGES,
    TASK_TYPES,
    MtebEncoder,
    default_similarity,
    embed_width,
    import_mteb,
    model_meta,
    mteb_evaluate,
    parameter_counts,
)
from care.evaluation.mteb_adapter.nano import (
    MAIN_SCORES,
    MTEB_SUBSET,
    load_in_memory,
    load_with_mteb_loader,
    nano_task,
    run_mteb,
    split_revision,
)
from care.evaluation.mteb_adapter.results import load_results, meta_fields, model_folder, results_dir
from care.evaluation.mteb_adapter.run import compare, evaluate_tasks, print_comparison, project_scores
from care.evaluation.mteb_adapter.scores import (
    DATA_TYPES,
    DEFAULT_METRICS,
    FAMILIES,
    MTEB_TYPES,
    STS_SCORES,
    default_spec,
    mteb_score,
    project_metric,
)
from care.evaluation.mteb_adapter.tasks import (
    benchmark_tasks,
    cmteb_task,
    data_revision,
    load_project_benchmarks,
    mteb_task,
    registered_task,
    retrieval_split,
)

__all__ = [
    "DATA_TYPES", "DEFAULT_METRICS", "FAMILIES", "LANGUAGES", "LOCAL_LAYOUTS", "MAIN_SCORES", "MTEB_SUBSET",
    "MTEB_TYPES", "STS_SCORES", "TASK_TYPES", "USAGE", "MtebEncoder", "benchmark_tasks", "care_spec", "cmteb_task",
    "compare", "data_revision", "default_similarity", "default_spec", "embed_width", "encoder_from_config",
    "evaluate_config", "evaluate_tasks", "import_mteb", "load_hub_task", "load_in_memory", "load_local_copy",
    "load_project_benchmarks", "load_results", "load_with_mteb_loader", "main", "main_nano", "meta_fields",
    "model_folder", "model_meta", "mteb_document_text", "mteb_evaluate", "mteb_score", "mteb_task", "nano_task",
    "parameter_counts", "print_comparison", "project_metric", "project_scores", "read_parquet_copy",
    "registered_task", "results_dir", "retrieval_data", "retrieval_split", "run_mteb", "split_revision",
    "task_data",
]
