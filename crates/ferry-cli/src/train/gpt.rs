//! `ferry train gpt` and `ferry train llama`: a small character-level GPT or Llama on Cicero's *De finibus bonorum et malorum*,
//! book I (Latin, public domain), as the `lipsum` crate ships it (`lipsum::LIBER_PRIMUS`,
//! 49 KB): nothing is copied into this repository.
//!
//! The model is [`ferry::models::Gpt`] (GPT-2's shape at a small size, `--layers` pre-norm
//! blocks; tests/torch/gpt.py builds the same model in PyTorch for the loss comparison) or
//! [`ferry::models::Llama`] of the same width, depth and heads (its MLP 8/3 as wide, rounded
//! up to a multiple of 8; `--kv-heads` key/value heads).
//!
//! Text: characters, the first 90% for training, the last 10% for validation. A step trains on
//! `--batch-size` windows of `--context` characters drawn at random (seeded per epoch); an
//! "epoch" is `--steps-per-epoch` steps, after which the validation loss and next-character
//! accuracy are measured, a checkpoint written and the curves redrawn.

use std::error::Error;

use ferry::models::{Gpt, GptConfig, Llama, LlamaConfig};
use ferry::nn::Module;
use ferry::optim::{AdamW, Constant, Cosine, LrSchedule, OffloadAdamW, Optimizer};
use ferry::prelude::*;
use ferry::train::{EpochEnd, Every, HostBatch, Scored, Task, TrainSummary};
use rand::{Rng, SeedableRng};

use super::TrainArgs;
use super::report::Report;

/// The text the model learns, and where it comes from.
pub const CORPUS: &str = lipsum::LIBER_PRIMUS;
pub const CORPUS_SOURCE: &str = "Cicero, De finibus bonorum et malorum, book I (Latin, public \
     domain), as shipped by the lipsum crate (crates.io, MIT) as lipsum::LIBER_PRIMUS";

/// The characters of a text as a vocabulary (sorted) and the text encoded with it.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub chars: Vec<char>,
    pub ids: Vec<i64>,
}

impl Corpus {
    pub fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = text
            .chars()
            .map(|c| {
                chars
                    .binary_search(&c)
                    .expect("every char is in the vocabulary") as i64
            })
            .collect();
        Self { chars, ids }
    }

    /// `count` windows of `context + 1` ids starting at random offsets in `range`: inputs
    /// `[count, context]` and targets (the next characters), both i64 on the host.
    pub fn windows(
        &self,
        range: std::ops::Range<usize>,
        count: usize,
        context: usize,
        rng: &mut impl Rng,
    ) -> ferry::Result<(Tensor, Tensor)> {
        let span = range.len().saturating_sub(context + 1).max(1);
        let (mut x, mut y) = (Vec::with_capacity(count * context), Vec::new());
        for _ in 0..count {
            let at = range.start + rng.random_range(0..span);
            x.extend_from_slice(&self.ids[at..at + context]);
            y.extend_from_slice(&self.ids[at + 1..at + context + 1]);
        }
        Ok((
            Tensor::from_vec(x, &[count, context])?,
            Tensor::from_vec(y, &[count, context])?,
        ))
    }

    pub fn decode(&self, ids: &[i64]) -> String {
        ids.iter().map(|&i| self.chars[i as usize]).collect()
    }
}

/// Mean cross-entropy of `model` on `x` -> `y` (both `[B, T]`), and how many next characters
/// its top guess got right (f32 scalar), detached.
pub fn loss_and_correct(
    model: &dyn Module,
    x: &Tensor,
    y: &Tensor,
) -> ferry::Result<(Tensor, Tensor)> {
    let scored = Scored::cross_entropy(&model.forward(x)?, y)?;
    Ok((scored.loss, scored.correct))
}

/// `len` characters sampled from `model` after `prompt` (temperature `temperature`, seeded).
pub fn sample(
    model: &dyn Module,
    context: usize,
    corpus: &Corpus,
    prompt: &str,
    len: usize,
    temperature: f64,
    seed: u64,
) -> Result<String, Box<dyn Error>> {
    let device = model.parameters()[0].device();
    let vocab = corpus.chars.len();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids: Vec<i64> = prompt
        .chars()
        .filter_map(|c| corpus.chars.binary_search(&c).ok().map(|i| i as i64))
        .collect();
    if ids.is_empty() {
        ids.push(0);
    }
    let start = ids.len();
    for _ in 0..len {
        let window = &ids[ids.len().saturating_sub(context)..];
        let x = Tensor::from_vec(window.to_vec(), &[1, window.len()])?.to(device)?;
        let logits = with_no_grad(|| model.forward(&x))?;
        let last = logits
            .narrow(1, window.len() - 1, 1)?
            .reshape(&[vocab])?
            .to_vec_f64()?;
        let max = last.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = last
            .iter()
            .map(|l| ((l - max) / temperature).exp())
            .collect();
        let mut pick = rng.random::<f64>() * weights.iter().sum::<f64>();
        let mut next = weights.len() - 1;
        for (i, w) in weights.iter().enumerate() {
            if pick < *w {
                next = i;
                break;
            }
            pick -= w;
        }
        ids.push(next as i64);
    }
    Ok(corpus.decode(&ids[start..]))
}

/// Next characters of the corpus: each step `batch` windows of `context` characters drawn at
/// random from the first 90% (seeded per epoch); scored by next-character accuracy on fixed
/// windows of the last 10%.
struct NextChar<'a> {
    corpus: &'a Corpus,
    split: usize,
    batch: usize,
    context: usize,
    steps: usize,
    device: Device,
}

/// Windows of the held-out tenth the score is measured on.
const HELD_OUT_WINDOWS: usize = 64;

impl Task for NextChar<'_> {
    fn steps_per_epoch(&self) -> usize {
        self.steps
    }

    fn batches(
        &self,
        _epoch: usize,
        seed: u64,
    ) -> Box<dyn Iterator<Item = ferry::Result<HostBatch>> + '_> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        Box::new((0..self.steps).map(move |_| {
            self.corpus
                .windows(0..self.split, self.batch, self.context, &mut rng)
        }))
    }

    fn evaluate(&self, model: &mut dyn Module) -> ferry::Result<f64> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xF00D);
        let held_out = self.split..self.corpus.ids.len();
        let (x, y) = self
            .corpus
            .windows(held_out, HELD_OUT_WINDOWS, self.context, &mut rng)?;
        let (_, correct) =
            with_no_grad(|| loss_and_correct(model, &x.to(self.device)?, &y.to(self.device)?))?;
        Ok(correct.item()? / (HELD_OUT_WINDOWS * self.context) as f64)
    }
}

/// AdamW's rate: a linear warmup over the first 5% of all steps from a warmup's share of the
/// peak, then a cosine to a tenth of it (or, with `--constant-lr`, the peak).
fn schedule(args: &TrainArgs, lr: f64) -> ferry::Result<Box<dyn LrSchedule>> {
    let total = (args.epochs * args.steps_per_epoch.max(1)) as u64;
    let warmup = ((total as f64 * 0.05).round() as u64).max(1);
    let start = 1.0 / warmup as f64;
    Ok(if args.constant_lr {
        Box::new(Constant::new(lr)?.with_warmup(warmup).start_factor(start)?)
    } else {
        let decay = Cosine::new(lr, total.saturating_sub(warmup).max(1))?.floor(lr * 0.1)?;
        Box::new(decay.with_warmup(warmup).start_factor(start)?)
    })
}

/// A model and the name `ferry train` calls it by.
type Named = (Box<dyn Module>, &'static str);

/// The model `ferry train` was asked for, sized by the flags, with its name.
fn model(args: &TrainArgs, vocab: usize, device: Device) -> Result<Named, Box<dyn Error>> {
    if args.task != super::Task::Llama {
        let config = GptConfig {
            vocab,
            context: args.context,
            width: args.width,
            layers: args.layers,
            heads: args.heads,
        };
        let mut gpt = Gpt::new(config, device)?;
        gpt.set_recompute(args.recompute);
        return Ok((Box::new(gpt), "gpt"));
    }
    let kv_heads = args.kv_heads.unwrap_or(if args.heads.is_multiple_of(2) {
        args.heads / 2
    } else {
        args.heads
    });
    let mlp = (args.width * 8 / 3).div_ceil(8) * 8;
    let config = LlamaConfig {
        max_position_embeddings: args.context,
        ..LlamaConfig::new(vocab, args.width, mlp, args.layers, args.heads, kv_heads)
    };
    if let Err(why) = config.check() {
        return Err(format!(
            "llama of --width {} --heads {} --kv-heads {kv_heads}: {why}",
            args.width, args.heads
        )
        .into());
    }
    let mut llama = Llama::new(config, device)?;
    llama.set_recompute(args.recompute);
    Ok((Box::new(llama), "llama"))
}

/// `ferry train gpt`: trains (or resumes) the character-level GPT, checkpointing and redrawing
/// the curves each epoch (`--steps-per-epoch` steps), and prints samples at the end.
pub(super) fn train(args: &TrainArgs) -> Result<TrainSummary, Box<dyn Error>> {
    if args.devices.len() > 1 {
        return Err("--devices (data-parallel) trains the digits task only; use --device".into());
    }
    let device = args.devices.first().copied().unwrap_or(args.device);
    let corpus = Corpus::new(CORPUS);
    let out = args.out_dir();
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    // The text, for tests/torch/gpt.py (the PyTorch twin of this model).
    let corpus_file = out.join("corpus.txt");
    std::fs::write(&corpus_file, CORPUS)
        .map_err(|e| format!("cannot write {}: {e}", corpus_file.display()))?;
    let lr = args.lr.unwrap_or(3e-3);
    ferry::manual_seed(args.seed);
    let (mut model, name) = model(args, corpus.chars.len(), device)?;
    if let Some(bytes) = args.device_budget {
        let Device::Cuda(ordinal) = device else {
            return Err("--device-budget caps a GPU's allocator: give a --device cuda:N".into());
        };
        ferry::memory::cuda::CudaDevice::get(ordinal)?.set_budget(Some(bytes));
    }
    let mut opt: Box<dyn Optimizer> = if args.offload_optimizer {
        let opt = OffloadAdamW::new(model.parameters(), lr)?
            .weight_decay(args.weight_decay)
            .hold_gradients(args.clip_grad_norm.is_some());
        let pinned = match opt.staging() {
            Some(staging) => staging.to_string(),
            None => format!(
                "{:.2} GB pinned for the copies",
                opt.pinned_bytes() as f64 / 1e9
            ),
        };
        super::say(
            args,
            &format!(
                "optimizer state on the host: {:.2} GB; {pinned}",
                opt.state_bytes() as f64 / 1e9,
            ),
        );
        Box::new(opt)
    } else {
        Box::new(AdamW::new(model.parameters(), lr)?.weight_decay(args.weight_decay))
    };
    super::say(
        args,
        &format!(
            "{name}: {} parameters, {} characters ({} distinct) of {CORPUS_SOURCE}",
            model.num_parameters(),
            corpus.ids.len(),
            corpus.chars.len()
        ),
    );
    let task = NextChar {
        corpus: &corpus,
        split: corpus.ids.len() * 9 / 10,
        batch: args.batch(),
        context: args.context,
        steps: args.steps_per_epoch.max(1),
        device,
    };
    let line = |end: &EpochEnd<'_>| {
        format!(
            "epoch {}/{}: loss {:.4}, next-char accuracy {:.4} (train), {:.4} (held out)",
            end.epoch,
            end.epochs,
            end.stats.loss,
            end.stats.train_accuracy,
            end.stats.test_accuracy
        )
    };
    let mut report = Report::new(args, &line);
    let summary = super::trainer(args, device)
        .schedule(schedule(args, lr)?, Every::Step)
        .fit(model.as_mut(), opt.as_mut(), None, &task, &mut report)
        .map_err(super::explain)?;
    if !args.quiet {
        for seed in 0..2 {
            let text = sample(
                model.as_ref(),
                args.context,
                &corpus,
                "Non eram nescius, ",
                160,
                0.8,
                seed,
            )?;
            println!("sample {}: Non eram nescius, {text}", seed + 1);
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_corpus_round_trips_and_windows_are_shifted_by_one() {
        let corpus = Corpus::new(CORPUS);
        assert!(corpus.ids.len() > 40_000, "{}", corpus.ids.len());
        assert!(corpus.chars.len() < 100);
        assert_eq!(corpus.decode(&corpus.ids[..16]), &CORPUS[..16]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let (x, y) = corpus.windows(0..1000, 3, 8, &mut rng).unwrap();
        let (x, y) = (x.to_vec::<i64>().unwrap(), y.to_vec::<i64>().unwrap());
        for w in 0..3 {
            assert_eq!(x[w * 8 + 1..w * 8 + 8], y[w * 8..w * 8 + 7]);
        }
    }

    #[test]
    fn a_tiny_gpt_learns_to_lower_its_loss_on_the_cpu() {
        ferry::manual_seed(0);
        let corpus = Corpus::new(CORPUS);
        let config = GptConfig {
            vocab: corpus.chars.len(),
            context: 16,
            width: 32,
            layers: 2,
            heads: 4,
        };
        let model = Gpt::new(config, Device::Cpu).unwrap();
        let names: Vec<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert!(
            names.contains(&"blocks.1.attn.qkv.weight".to_string()),
            "{names:?}"
        );
        let mut opt = ferry::optim::AdamW::new(model.parameters(), 3e-3).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let mut first = None;
        let mut last = 0.0;
        for _ in 0..60 {
            let (x, y) = corpus.windows(0..40_000, 16, 16, &mut rng).unwrap();
            use ferry::optim::Optimizer;
            opt.zero_grad();
            let (loss, _) = loss_and_correct(&model, &x, &y).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            last = loss.item().unwrap();
            first.get_or_insert(last);
        }
        let first = first.unwrap();
        // ln(vocab) at the start; a model that learned character frequencies is well below.
        assert!((first - (config.vocab as f64).ln()).abs() < 0.3, "{first}");
        assert!(last < first - 0.8, "{first} -> {last}");
        let text = sample(&model, 16, &corpus, "Non eram", 20, 1.0, 0).unwrap();
        assert_eq!(text.chars().count(), 20);
    }
}
