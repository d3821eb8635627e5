package nats

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/inbox"
)

// newEngine is the consumer engine for cc.Consumer with the topology's
// lanes (Workers) and retry policy. JetStream redelivers a nacked message
// after its delay while it goes on delivering later ones, so a record
// waiting behind its group's retrying head is held in memory (HoldDeferred)
// and kept in progress until the head settles.
func newEngine(cfg *Config, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (*inbox.Engine, Consumer, error) {
	c, ok := cfg.Topology.Consumer(cc.Consumer)
	if !ok {
		return nil, Consumer{}, fmt.Errorf("consumer %q is not in the topology", cc.Consumer)
	}
	if cc.Logger == nil {
		cc.Logger = cfg.Logger
	}
	e, err := inbox.NewEngine(db, apply, inbox.EngineConfig{ConsumerConfig: cc, Lanes: c.Workers,
		MaxRetries: c.Retry.MaxRetries, RetryDelay: c.Retry.Delay, HoldDeferred: true})
	if err != nil {
		return nil, Consumer{}, err
	}
	return e, c, nil
}

// delivery is one message as delivered: the inbox.Record's Handle.
type delivery struct {
	m  jetstream.Msg
	md *jetstream.MsgMetadata
}

func (d *delivery) seq() uint64 { return d.md.Sequence.Stream }

// record wraps a delivered message for the engine. The message's own
// failures are counted by the engine (inbox_parked), not by JetStream's
// delivery count, which also counts redeliveries that were not failures.
func (c Consumer) record(m jetstream.Msg, md *jetstream.MsgMetadata) *inbox.Record {
	return &inbox.Record{ID: strconv.FormatUint(md.Sequence.Stream, 10), Body: m.Data(), Deliveries: int(md.NumDelivered),
		LastDelivery: c.MaxDeliver > 0 && int(md.NumDelivered) >= c.MaxDeliver, Handle: &delivery{m: m, md: md}}
}

// broker settles records on JetStream for the engine: Ack, NakWithDelay,
// and a dead-letter stream copy followed by Term; InProgress keeps what
// the engine holds from being redelivered.
type broker struct {
	topo *Topology
	c    Consumer
	dlq  *sender
	log  *slog.Logger
}

var (
	_ inbox.Broker = (*broker)(nil)
	_ inbox.Keeper = (*broker)(nil)
)

// Ack acknowledges r. A lost acknowledgement means a redelivery, which the
// inbox recognises; it is not an error.
func (b *broker) Ack(_ context.Context, r *inbox.Record) error {
	if err := r.Handle.(*delivery).m.Ack(); err != nil {
		b.log.Warn("nats consumer: acknowledgement not sent; the message comes back and is recognised", "consumer", b.c.Name, "stream_seq", r.ID, "error", err.Error())
	}
	return nil
}

// Retry nacks r to be redelivered after rt.Delay. If the nak is lost the
// server redelivers after AckWait instead; the group stays parked either
// way (inbox_parked).
func (b *broker) Retry(_ context.Context, r *inbox.Record, rt inbox.Retry) error {
	if err := r.Handle.(*delivery).m.NakWithDelay(rt.Delay); err != nil {
		b.log.Warn("nats consumer: nak not sent; the message comes back after ack_wait", "consumer", b.c.Name, "stream_seq", r.ID, "error", err.Error())
	}
	return nil
}

// DeadLetter publishes r to the dead-letter stream with the reason (waiting
// for the PubAck), then terminates it. If the dead-letter stream does not
// take it, r is not settled: the engine's session ends and r comes back.
func (b *broker) DeadLetter(ctx context.Context, r *inbox.Record, dl inbox.DeadLetter) error {
	d := r.Handle.(*delivery)
	h := natsgo.Header{}
	for k, v := range d.m.Headers() {
		if !strings.HasPrefix(strings.ToLower(k), "nats-") {
			h[k] = v
		}
	}
	h[HeaderErrorClass] = []string{dl.Class}
	h[HeaderErrorReason] = []string{headerValue(dl.Reason)}
	h[HeaderConsumer] = []string{b.c.Name}
	h[HeaderDeadAt] = []string{time.Now().UTC().Format(time.RFC3339Nano)}
	h[HeaderDeliveries] = []string{strconv.FormatUint(d.md.NumDelivered, 10)}
	h[HeaderSubject] = []string{d.m.Subject()}
	h[HeaderStreamSeq] = []string{strconv.FormatUint(d.seq(), 10)}
	// One id per (consumer, stream message): a resend after a lost PubAck is
	// dropped by the dead-letter stream's duplicate window.
	h[HeaderMsgID] = []string{fmt.Sprintf("%s:%s:%d", b.c.Name, b.topo.Stream, d.seq())}
	msg := &natsgo.Msg{Subject: b.topo.DLQSubject(b.c), Data: d.m.Data(), Header: h}
	if err := b.dlq.sendOne(ctx, outgoing{msg: msg, stream: b.topo.DeadLetterStream}); err != nil {
		return fmt.Errorf("dead-letter stream %s: %w", b.topo.DeadLetterStream, err)
	}
	if err := d.m.Term(); err != nil {
		// Redelivered later and dead-lettered again; the dead-letter
		// stream drops the copy inside its duplicate window.
		b.log.Warn("nats consumer: term not sent", "consumer", b.c.Name, "stream_seq", r.ID, "error", err.Error())
	}
	return nil
}

// KeepAlive sends InProgress for every record the engine holds, queued,
// running, behind a retrying head or waiting out a database outage, so
// the server redelivers none of them while the engine still has it.
func (b *broker) KeepAlive(_ context.Context, rs []*inbox.Record) {
	for _, r := range rs {
		_ = r.Handle.(*delivery).m.InProgress()
	}
}

// KeepAliveEvery is a quarter of AckWait: two InProgress can be lost
// before the server would redeliver.
func (b *broker) KeepAliveEvery() time.Duration {
	return max(time.Duration(b.c.AckWait)/4, 50*time.Millisecond)
}
