// Package transport is the seam between fifobox's broker-free core and the
// brokers it publishes through: SNS/SQS FIFO (pkg/transport/sns, the
// default), RabbitMQ / Amazon MQ (pkg/transport/amqp) and NATS JetStream
// (pkg/transport/nats).
//
// The layering, from the database outwards:
//
//	pkg/envelope    the event shape every part shares (no I/O)
//	pkg/outbox      Enqueue in the caller's transaction, the claim, the
//	                Dispatcher and the Publisher interface; no broker imports
//	pkg/inbox       the consumer engine every transport feeds (Engine): a
//	                side effect applied once per (consumer, event id) in the
//	                transaction of the inbox claim, per-aggregate lanes,
//	                durable holds and retry parks, over transport-neutral
//	                records; no broker imports
//	pkg/redrive     the operator's actions: database work, and the broker's
//	                part through Operations; no broker imports
//	pkg/transport   this package: the small interfaces a transport
//	                implements, Open (the one constructor, from
//	                FIFOBOX_TRANSPORT) and RetryPolicy; no broker imports
//	                either
//	pkg/transport/* one package per transport, each implementing the same
//	                four parts: a Publisher (outbox.Publisher), a
//	                Provisioner (topology as data, set up idempotently), a
//	                consumer Runner (and, where AWS has an event source for
//	                it, a Lambda handler: LambdaConsumer), and Operations
//	                (depths, redrive, replay); Transport bundles them and
//	                the package registers it with Register in its init
//
// Imports point inwards only: a transport imports outbox, inbox and this
// package; outbox, inbox and redrive never import a transport, so deleting
// a transport's directory leaves the core building
// (`go list -deps ./pkg/outbox ./pkg/inbox ./pkg/redrive | grep transport/`
// prints nothing). Programs choose their transports by importing the
// packages (the Lambdas through pkg/lambdafn, the CLI, make local); only
// the transport packages know which kind they are.
//
// What every transport must keep, whatever its broker calls things:
//   - Publish returns nil for a message only once the broker has durably
//     accepted it (a publisher confirm, a JetStream ack, an SNS 200 entry),
//     envelope.Permanent only when no retry can help, and a plain error
//     otherwise. The dispatcher publishes an aggregate's event N+1 only after
//     N's Publish returned nil, so a transport keeps per-aggregate order at
//     the broker by acknowledging honestly; it never reorders on its own.
//   - A consumer is inbox.Engine fed by the transport: the transport
//     supplies receive (Session.Submit), acknowledge, retry-later and
//     dead-letter (inbox.Broker), and keeps alive what the engine holds
//     where its broker would redeliver it (inbox.Keeper); the engine decides
//     every settlement once, after the inbox transaction committed. So every
//     transport acknowledges only applied events, retries transient failures
//     with backoff without letting a later event of the aggregate overtake
//     (parks in inbox_parked, surviving restarts), counts failures per event
//     (never deliveries or infrastructure failures), dead-letters invalid,
//     permanently failing and exhausted events with the reason, and in strict
//     order holds the aggregate behind a dead-lettered event (inbox_held)
//     until redrive or release. pkg/transport/transporttest is the suite
//     every transport passes.
//   - Operations move dead messages back in the order they died, and replay
//     re-sends stored events to one consumer only.
package transport
