//! Recomputed regions (`ferry_tensor::recompute`, and `recompute_selective`, which keeps the
//! products' outputs): the gradients of every parameter and input equal the region's without
//! recomputation (bit for bit on the CPU), dropout and autocast included; only the region's
//! inputs are kept (and its products', selective); and what a region cannot do is refused,
//! named.

use ferry::amp::autocast;
use ferry_tensor::autograd::{self, GradOptions};
use ferry_tensor::{
    DType, Device, Result, Tensor, keep_products, manual_seed, recompute, recompute_selective,
    reuse_products,
};
use ferry_tests::{device_test, on, values};

/// A block as models have them: `x + W2·dropout(gelu(W1·x))`, its weights captured.
fn block(
    w1: &Tensor,
    w2: &Tensor,
    p: f64,
) -> impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static {
    let (w1, w2) = (w1.clone(), w2.clone());
    move |x: &[Tensor]| {
        let h = x[0].matmul(&w1.t()?)?.gelu()?.dropout(p, true)?;
        x[0].add(&h.matmul(&w2.t()?)?)
    }
}

struct Run {
    x_grad: Vec<f64>,
    w_grads: [Vec<f64>; 2],
    loss: Vec<f64>,
}

/// How a block runs: as is, recomputed whole, or recomputed with its products kept.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    Plain,
    Whole,
    Selective,
}

/// Two blocks on `x`, each run `way`, then a sum; the gradients.
fn two_blocks(device: Device, way: Way, p: f64, low: Option<DType>) -> Result<Run> {
    manual_seed(7);
    let make = |shape: &[usize]| -> Result<Tensor> {
        on(
            device,
            Tensor::randn(shape, DType::F32, Device::Cpu)?.mul_scalar(0.3)?,
        )?
        .with_grad()
    };
    let (w1, w2) = (make(&[32, 16])?, make(&[16, 32])?);
    let x = make(&[8, 16])?;
    manual_seed(11); // the dropout masks
    let forward = || -> Result<Tensor> {
        let f = block(&w1, &w2, p);
        let mut h = x.clone();
        for _ in 0..2 {
            h = match way {
                Way::Whole => recompute(&[&h], block(&w1, &w2, p))?,
                Way::Selective => recompute_selective(&[&h], block(&w1, &w2, p))?,
                Way::Plain => f(&[h])?,
            };
        }
        h.to_dtype(DType::F32)?.tanh()?.sum()
    };
    let loss = match low {
        Some(dtype) => autocast(dtype, forward)?,
        None => forward()?,
    };
    loss.backward()?;
    Ok(Run {
        x_grad: values(&x.grad().unwrap()),
        w_grads: [values(&w1.grad().unwrap()), values(&w2.grad().unwrap())],
        loss: values(&loss),
    })
}

fn same_gradients(device: Device) -> Result<()> {
    for (p, low, way) in [(0.0, None), (0.3, None), (0.3, Some(DType::BF16))]
        .into_iter()
        .flat_map(|(p, low)| [(p, low, Way::Whole), (p, low, Way::Selective)])
    {
        let plain = two_blocks(device, Way::Plain, p, low)?;
        let again = two_blocks(device, way, p, low)?;
        let what = format!("{way:?}, dropout {p}, autocast {low:?}");
        assert_eq!(plain.loss, again.loss, "{what}: loss");
        if device == Device::Cpu {
            // Every host kernel is deterministic: the same bits.
            assert_eq!(plain.x_grad, again.x_grad, "{what}: x");
            assert_eq!(plain.w_grads, again.w_grads, "{what}: weights");
        } else {
            let close = |a: &[f64], b: &[f64]| {
                a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + x.abs()))
            };
            assert!(close(&plain.x_grad, &again.x_grad), "{what}: x");
            for i in 0..2 {
                assert!(close(&plain.w_grads[i], &again.w_grads[i]), "{what}: w{i}");
            }
        }
    }
    Ok(())
}
device_test!(
    recomputed_regions_give_the_gradients_of_plain_ones,
    same_gradients
);

/// A region keeps its input alone: the graph's saved bytes after the forward are the input's,
/// against every intermediate of the plain block.
#[test]
fn a_region_keeps_only_its_inputs() -> Result<()> {
    let w1 = Tensor::randn(&[256, 64], DType::F32, Device::Cpu)?.with_grad()?;
    let w2 = Tensor::randn(&[64, 256], DType::F32, Device::Cpu)?.with_grad()?;
    let x = Tensor::randn(&[128, 64], DType::F32, Device::Cpu)?.with_grad()?;
    let graph = w1.graph().expect("a leaf has a graph");
    let base = graph.saved_bytes();
    let plain = block(&w1, &w2, 0.0)(std::slice::from_ref(&x))?;
    let plain_bytes = graph.saved_bytes() - base;
    drop(plain);
    let base = graph.saved_bytes();
    let region = recompute(&[&x], block(&w1, &w2, 0.0))?;
    let region_bytes = graph.saved_bytes() - base;
    assert_eq!(region_bytes, 128 * 64 * 4, "the input alone");
    assert!(
        plain_bytes >= 3 * 128 * 256 * 4,
        "the plain block keeps its hidden activations: {plain_bytes}"
    );
    assert_eq!(region.shape(), [128, 64]);
    drop(region);
    // Selective: the input and the two products' outputs, [128, 256] and [128, 64].
    let base = graph.saved_bytes();
    let selective = recompute_selective(&[&x], block(&w1, &w2, 0.0))?;
    let selective_bytes = graph.saved_bytes() - base;
    assert_eq!(selective_bytes, (128 * 64 + 128 * 256 + 128 * 64) * 4);
    assert!(selective_bytes < plain_bytes);
    drop(selective);
    Ok(())
}

/// The kept outputs go back to the same ops of the second run, in order; where the second run
/// differs (another shape), that op and every later one compute, and the result is still right.
#[test]
fn a_second_run_takes_the_kept_products_back() -> Result<()> {
    let w1 = Tensor::randn(&[32, 16], DType::F32, Device::Cpu)?;
    let w2 = Tensor::randn(&[16, 32], DType::F32, Device::Cpu)?;
    let x = Tensor::randn(&[8, 16], DType::F32, Device::Cpu)?;
    let f = block(&w1, &w2, 0.0);
    let plain = values(&f(std::slice::from_ref(&x))?);
    let (first, kept) = keep_products(|| f(std::slice::from_ref(&x)));
    assert_eq!(values(&first?), plain);
    assert_eq!(kept.len(), 2, "two products");
    assert_eq!(kept.bytes(), (8 * 32 + 8 * 16) * 4);
    let (again, fell_back) = reuse_products(kept, || f(std::slice::from_ref(&x)));
    assert_eq!((values(&again?), fell_back), (plain.clone(), 0));
    // Kept for 8 rows, run on 4: the first product does not fit, so nothing is reused: both
    // products compute.
    let (_, kept) = keep_products(|| f(std::slice::from_ref(&x)));
    let half = x.narrow(0, 0, 4)?;
    let (other, fell_back) = reuse_products(kept, || f(std::slice::from_ref(&half)));
    assert_eq!(fell_back, 2);
    assert_eq!(values(&other?), values(&f(&[half])?));
    Ok(())
}

#[test]
fn what_a_region_cannot_do_is_refused() -> Result<()> {
    let w = Tensor::randn(&[4, 4], DType::F32, Device::Cpu)?.with_grad()?;
    let x = Tensor::randn(&[2, 4], DType::F32, Device::Cpu)?.with_grad()?;
    let f = {
        let w = w.clone();
        move |i: &[Tensor]| i[0].matmul(&w)
    };
    // No input that requires grad: its parameters would never get theirs.
    let plain = x.detach();
    let err = recompute(&[&plain], f.clone()).unwrap_err().to_string();
    assert!(err.contains("no input requires a gradient"), "{err}");
    // An input written in place before backward.
    let y = x.detach().copy()?.with_grad()?;
    let h = y.mul_scalar(2.0)?;
    let out = recompute(&[&h], f.clone())?;
    ferry_tensor::with_no_grad(|| h.assign(&Tensor::zeros(&[2, 4], DType::F32, Device::Cpu)?))?;
    let err = out.sum()?.backward().unwrap_err().to_string();
    assert!(err.contains("modified in place"), "{err}");
    // `grad` leaves .grad alone; a region cannot.
    let out = recompute(&[&x], f.clone())?;
    let err = autograd::grad(&[&out.sum()?], &[&x], GradOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("call `backward()`"), "{err}");
    // Outside grad mode the closure just runs.
    let out = ferry_tensor::with_no_grad(|| recompute(&[&x], f.clone()))?;
    assert!(!out.requires_grad());
    Ok(())
}

/// `nn::Recomputed` around a module: the plain module's gradients, bit for bit on the CPU, and a
/// parameter stepped between the forward and its backward is refused.
#[test]
fn a_recomputed_module_trains_as_the_plain_one() -> Result<()> {
    use ferry::nn::{Linear, Module, Recomputed, Sequential, Tanh};
    let make = || -> Result<Sequential> {
        manual_seed(3);
        Ok(Sequential::new()
            .push(Linear::new(16, 64, Device::Cpu)?)
            .push(Tanh)
            .push(Linear::new(64, 16, Device::Cpu)?))
    };
    let (plain, region) = (make()?, Recomputed::new(make()?));
    let x = Tensor::randn(&[8, 16], DType::F32, Device::Cpu)?;
    plain.forward(&x.with_grad()?)?.sum()?.backward()?;
    region.forward(&x.with_grad()?)?.sum()?.backward()?;
    let grads = |m: &dyn Module| -> Vec<Vec<f64>> {
        m.parameters()
            .iter()
            .map(|p| values(&p.grad().unwrap()))
            .collect()
    };
    assert_eq!(grads(&plain), grads(&region));

    let out = region.forward(&x.with_grad()?)?;
    let w = region.parameters()[0].clone();
    ferry_tensor::with_no_grad(|| w.assign(&w.mul_scalar(0.5)?))?;
    let err = out.sum()?.backward().unwrap_err().to_string();
    assert!(err.contains("written in place between"), "{err}");
    Ok(())
}

/// A GPT of `layers` blocks (vocabulary 32, context 16, width 32, 4 heads), a batch of 2 x 16
/// ids and the 32 targets of its positions.
fn tiny_gpt(layers: usize) -> Result<(ferry::models::GptConfig, Tensor, Tensor)> {
    let config = ferry::models::GptConfig {
        vocab: 32,
        context: 16,
        width: 32,
        layers,
        heads: 4,
    };
    let ids = Tensor::from_vec((0..32).map(|i| (i * 7 % 32) as i64).collect(), &[2, 16])?;
    let targets = Tensor::from_vec((0..32).map(|i| (i * 5 % 32) as i64).collect(), &[32])?;
    Ok((config, ids, targets))
}

/// ferry's GPT with each block recomputed: the plain model's loss and gradients, bit for bit on
/// the CPU, under bf16 autocast too, for a fraction of the saved bytes.
#[test]
fn a_gpt_with_recomputed_blocks_trains_as_the_plain_one() -> Result<()> {
    use ferry::models::Gpt;
    use ferry::nn::{Module, cross_entropy};
    let (config, ids, targets) = tiny_gpt(3)?;
    for low in [None, Some(DType::BF16)] {
        let run = |recompute: bool| -> Result<(Vec<f64>, Vec<Vec<f64>>, usize)> {
            manual_seed(5);
            let mut gpt = Gpt::new(config, Device::Cpu)?;
            gpt.set_recompute(recompute);
            let graph = gpt.parameters()[0].graph().expect("a leaf has a graph");
            let base = graph.saved_bytes();
            let forward = || -> Result<Tensor> {
                let logits = gpt.forward(&ids)?;
                cross_entropy(&logits.reshape(&[32, 32])?, &targets)
            };
            let loss = match low {
                Some(dtype) => autocast(dtype, forward)?,
                None => forward()?,
            };
            let saved = graph.saved_bytes() - base;
            loss.backward()?;
            let grads = gpt
                .parameters()
                .iter()
                .map(|p| values(&p.grad().unwrap()))
                .collect();
            Ok((values(&loss), grads, saved))
        };
        let (plain, again) = (run(false)?, run(true)?);
        assert_eq!(plain.0, again.0, "{low:?}: loss");
        assert_eq!(plain.1, again.1, "{low:?}: gradients");
        assert!(
            again.2 * 2 < plain.2,
            "{low:?}: saved {} against {}",
            again.2,
            plain.2
        );
    }
    Ok(())
}

/// ferry's GPT under a memory plan made from its own profiled blocks: the plan frees what it
/// predicts (the blocks it recomputes saved their bytes in the profile), its peak fits the
/// target, and loss and gradients equal the plain model's bit for bit on the CPU; a plan of the
/// wrong length is refused.
#[test]
fn a_gpt_under_a_memory_plan_trains_as_the_plain_one() -> Result<()> {
    use ferry::autograd::{Choice, MemoryPlan};
    use ferry::models::Gpt;
    use ferry::nn::{Module, cross_entropy};
    let (config, ids, targets) = tiny_gpt(4)?;
    let run = |plan: Option<&[Choice]>| -> Result<(Vec<f64>, Vec<Vec<f64>>, usize)> {
        manual_seed(9);
        let mut gpt = Gpt::new(config, Device::Cpu)?;
        if let Some(choices) = plan {
            gpt.set_plan(choices)?;
        }
        let graph = gpt.parameters()[0].graph().expect("a leaf has a graph");
        let base = graph.saved_bytes();
        let loss = cross_entropy(&gpt.forward(&ids)?.reshape(&[32, 32])?, &targets)?;
        let saved = graph.saved_bytes() - base;
        loss.backward()?;
        let grads = gpt
            .parameters()
            .iter()
            .map(|p| values(&p.grad().unwrap()))
            .collect();
        Ok((values(&loss), grads, saved))
    };

    manual_seed(9);
    let gpt = Gpt::new(config, Device::Cpu)?;
    let costs = gpt.profile_blocks(&ids)?;
    assert_eq!(costs.len(), 4);
    for cost in &costs {
        assert_eq!(cost.input_bytes, 2 * 16 * 32 * 4, "{cost:?}");
        assert!(cost.saved_bytes > cost.input_bytes, "{cost:?}");
    }
    let kept: u64 = costs.iter().map(|c| c.input_bytes + c.saved_bytes).sum();
    // Half of the blocks' own bytes: two blocks recomputed (no link on the CPU).
    let target = kept - costs[0].saved_bytes - costs[1].saved_bytes;
    let plan = MemoryPlan::new(&costs, None, target)?;
    assert!(plan.reached(), "{plan}");
    let choices = plan.choices();
    let recomputed = choices.iter().filter(|c| **c == Choice::Recompute).count();
    assert_eq!(recomputed, 2, "{plan}");
    assert_eq!(
        choices[3],
        Choice::Keep,
        "the last block is rebuilt at once: {plan}"
    );

    let (plain, planned) = (run(None)?, run(Some(&choices))?);
    assert_eq!(plain.0, planned.0, "loss");
    assert_eq!(plain.1, planned.1, "gradients");
    let freed: u64 = costs
        .iter()
        .zip(&choices)
        .filter(|(_, c)| **c == Choice::Recompute)
        .map(|(cost, _)| cost.saved_bytes)
        .sum();
    // Graph-wise a recomputed block no longer saves its weights either; the profile leaves
    // them out (they stay alive whatever the plan): the graph's drop is the profiled bytes and
    // some of the recomputed blocks' parameters, no more.
    let gpt = Gpt::new(config, Device::Cpu)?;
    let recomputed_params: u64 =
        gpt.named_parameters()
            .iter()
            .filter(|(name, _)| {
                choices.iter().enumerate().any(|(i, c)| {
                    *c == Choice::Recompute && name.starts_with(&format!("blocks.{i}."))
                })
            })
            .map(|(_, p)| p.nbytes() as u64)
            .sum();
    let dropped = (plain.2 - planned.2) as u64;
    assert!(
        dropped > freed && dropped <= freed + recomputed_params,
        "graph dropped {dropped}, profile {freed}, parameters {recomputed_params}: {plan}"
    );

    // Selective recompute of every block: the same loss and gradients, and a graph between
    // keeping everything and recomputing every block (the products' outputs stay).
    for cost in &costs {
        let selective = cost.selective.expect("every block takes grad: measured");
        assert!(selective.held_bytes > 0, "{cost:?}");
        assert!(selective.held_bytes < cost.saved_bytes, "{cost:?}");
        assert_eq!(selective.offloadable_bytes, 0, "{cost:?}");
    }
    let selective = run(Some(&[Choice::Selective; 4]))?;
    let whole = run(Some(&[Choice::Recompute; 4]))?;
    assert_eq!(plain.0, selective.0, "loss");
    assert_eq!(plain.1, selective.1, "gradients");
    assert!(
        whole.2 < selective.2 && selective.2 < plain.2,
        "saved: whole {} < selective {} < plain {}",
        whole.2,
        selective.2,
        plain.2
    );

    let mut gpt = Gpt::new(config, Device::Cpu)?;
    let err = gpt.set_plan(&[Choice::Keep]).unwrap_err().to_string();
    assert!(err.contains("one choice per block"), "{err}");
    Ok(())
}

/// Any chain of blocks under a plan made from its own profile ([`ferry::nn::PlannedChain`]):
/// here an MLP whose blocks are chains of two `Dense` layers, so each block saves a hidden
/// activation inside it. The profile counts that activation and neither the block's input
/// (kept whatever the plan) nor its weights (parameters, alive anyway); the recomputed blocks
/// free it; loss and gradients equal the plain chain's bit for bit on the CPU.
#[test]
fn an_mlp_chain_under_a_memory_plan_trains_as_the_plain_one() -> Result<()> {
    use ferry::autograd::{Choice, MemoryPlan};
    use ferry::nn::{Activation, Dense, Module, PlannedChain};
    let chain = || -> Result<PlannedChain<PlannedChain<Dense>>> {
        manual_seed(5);
        let blocks = (0..4)
            .map(|_| {
                Ok(PlannedChain::new(vec![
                    Dense::new(32, 64, Activation::Tanh, Device::Cpu)?,
                    Dense::new(64, 32, Activation::Identity, Device::Cpu)?,
                ]))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PlannedChain::new(blocks))
    };
    manual_seed(6);
    let x = Tensor::randn(&[16, 32], DType::F32, Device::Cpu)?;
    let run = |plan: Option<&[Choice]>| -> Result<(Vec<f64>, Vec<Vec<f64>>, usize)> {
        let mut mlp = chain()?;
        if let Some(choices) = plan {
            mlp.set_plan(choices)?;
        }
        let graph = mlp.parameters()[0].graph().expect("a leaf has a graph");
        let base = graph.saved_bytes();
        let y = mlp.forward(&x)?;
        let loss = y.mul(&y)?.mean()?;
        let saved = graph.saved_bytes() - base;
        loss.backward()?;
        let grads = mlp
            .parameters()
            .iter()
            .map(|p| values(&p.grad().unwrap()))
            .collect();
        Ok((values(&loss), grads, saved))
    };

    let costs = chain()?.profile_blocks(&x)?;
    assert_eq!(costs.len(), 4);
    // The input, 16 x 32 floats; inside, the tanh's 16 x 64.
    for cost in &costs {
        assert_eq!(
            (cost.input_bytes, cost.saved_bytes),
            (2048, 4096),
            "{cost:?}"
        );
    }
    // The first block is fed the batch, which requires no grad: not recomputable.
    assert!(!costs[0].recomputable && costs[1..].iter().all(|c| c.recomputable));
    // The least the plan reaches: the middle blocks recomputed (the last is rebuilt at once).
    let plan = MemoryPlan::new(&costs, None, 1)?;
    let choices = plan.choices();
    use Choice::{Keep, Recompute};
    assert_eq!(choices, [Keep, Recompute, Recompute, Keep], "{plan}");
    let (plain, planned) = (run(None)?, run(Some(&choices))?);
    assert_eq!(plain.0, planned.0, "loss");
    assert_eq!(plain.1, planned.1, "gradients");
    // Graph-wise the recomputed blocks' two weights (64 x 32 floats each) go too.
    let dropped = (plain.2 - planned.2) as u64;
    assert_eq!(dropped, 2 * (4096 + 2 * 8192), "{plan}");
    // Every block asked to recompute: the first, fed the batch, runs kept; the same result.
    let all = run(Some(&[Recompute; 4]))?;
    assert_eq!((all.0, all.1), (plain.0.clone(), plain.1.clone()));
    // Parameters are named by position, as Sequential's.
    let names: Vec<String> = chain()?
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(&names[..2], ["0.0.weight", "0.0.bias"]);
    let err = chain()?.set_plan(&[Choice::Keep]).unwrap_err().to_string();
    assert!(err.contains("one choice per block"), "{err}");
    // ferry's own blocks keep a selective recompute's outputs on the device: offloading them is
    // refused, not run as another choice.
    let blocks = chain()?.blocks().len();
    let mut choices = vec![Choice::Keep; blocks];
    choices[0] = Choice::SelectiveOffload;
    let err = chain()?.set_plan(&choices).unwrap_err().to_string();
    assert!(err.contains("selective offload"), "{err}");
    Ok(())
}

/// The Llama under a plan made from its own profiled layers (under bf16 autocast, as it trains):
/// the plain model's loss and gradients bit for bit on the CPU, every layer recomputed included.
#[test]
fn a_llama_under_a_memory_plan_trains_as_the_plain_one() -> Result<()> {
    use ferry::autograd::{Choice, MemoryPlan};
    use ferry::models::{Llama, LlamaConfig};
    use ferry::nn::{Module, cross_entropy};
    let config = LlamaConfig::new(32, 32, 64, 3, 4, 2);
    let ids = Tensor::from_vec((0..24).map(|i| (i * 7 % 32) as i64).collect(), &[2, 12])?;
    let targets = Tensor::from_vec((0..24).map(|i| (i * 5 % 32) as i64).collect(), &[24])?;
    let run = |choices: &[Choice]| -> Result<(Vec<f64>, Vec<Vec<f64>>)> {
        manual_seed(3);
        let mut llama = Llama::new(config.clone(), Device::Cpu)?;
        llama.set_plan(choices)?;
        let loss = autocast(DType::BF16, || {
            cross_entropy(&llama.forward(&ids)?.reshape(&[24, 32])?, &targets)
        })?;
        loss.backward()?;
        let grads = llama
            .parameters()
            .iter()
            .map(|p| values(&p.grad().unwrap()))
            .collect();
        Ok((values(&loss), grads))
    };
    manual_seed(3);
    let llama = Llama::new(config.clone(), Device::Cpu)?;
    let costs = autocast(DType::BF16, || llama.profile_blocks(&ids))?;
    assert_eq!(costs.len(), 3);
    assert!(
        costs.iter().all(|c| c.saved_bytes > 0 && c.input_bytes > 0),
        "{costs:?}"
    );
    let kept: u64 = costs.iter().map(|c| c.input_bytes + c.saved_bytes).sum();
    let plan = MemoryPlan::new(&costs, None, kept - costs[0].saved_bytes)?;
    assert!(plan.reached(), "{plan}");

    let plain = run(&[Choice::Keep; 3])?;
    for choices in [plan.choices(), vec![Choice::Recompute; 3]] {
        let planned = run(&choices)?;
        assert_eq!(plain.0, planned.0, "loss under {choices:?}");
        assert_eq!(plain.1, planned.1, "gradients under {choices:?}");
    }
    let mut llama = Llama::new(config, Device::Cpu)?;
    assert!(llama.set_plan(&[Choice::Keep; 2]).is_err());
    Ok(())
}

/// Threads, each training a GPT of its own with every block selective (the keep/reuse mode is
/// per thread): the same losses as one thread alone, whatever runs beside it.
#[test]
fn selective_blocks_train_alike_in_threads() -> Result<()> {
    use ferry::autograd::Choice;
    use ferry::models::Gpt;
    use ferry::nn::{Module, cross_entropy};
    let (config, ids, targets) = tiny_gpt(4)?;
    let train = move || -> Result<Vec<f64>> {
        manual_seed(3);
        let mut gpt = Gpt::new(config, Device::Cpu)?;
        gpt.set_plan(&[Choice::Selective; 4])?;
        let mut losses = Vec::new();
        for _ in 0..3 {
            let loss = cross_entropy(&gpt.forward(&ids)?.reshape(&[32, 32])?, &targets)?;
            loss.backward()?;
            losses.extend(values(&loss));
        }
        Ok(losses)
    };
    let alone = train.clone()()?;
    for n in [1usize, 2, 4] {
        let start = std::time::Instant::now();
        let runs: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n).map(|_| s.spawn(train.clone())).collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a training thread"))
                .collect::<Result<_>>()
        })?;
        println!(
            "{n} threads, each 3 steps of its own GPT (every block selective): {:.1} ms",
            start.elapsed().as_secs_f64() * 1e3
        );
        assert!(
            runs.iter().all(|r| *r == alone),
            "{runs:?} against {alone:?}"
        );
    }
    Ok(())
}
