package amqp_test

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// A message the quorum queue dead-letters itself, at its delivery limit,
// with no settlement from the engine (the consumer dies on it every time):
// its aggregate's next event must not be applied before it. The engine
// holds the group in the database before the last delivery runs, so the
// next event follows it to the DLQ (class held), to be redriven after it.
func TestDeliveryLimitHoldsTheAggregate(t *testing.T) {
	t.Parallel()
	const limit = 2
	topo := amqp.Corewrite()
	topo.Consumers = topo.Consumers[:1]
	topo.Consumers[0].DeliveryLimit = limit
	topo.Consumers[0].Retry = fastRetry(5) // the engine's own budget is not what ends it
	cfg, v := setup(t, topo)
	c := cfg.Topology.Consumers[0]
	ctx := context.Background()
	first, next := newEvent("doc", "d-1", "doc.written", 1), newEvent("doc", "d-1", "doc.deleted", 2)
	pub := newPublisher(t, cfg)
	if errs := pub.Publish(ctx, []outbox.Message{message(first), message(next)}); errs[0] != nil || errs[1] != nil {
		t.Fatal(errs)
	}

	// The consumer died holding `first` `limit` times: a client takes it
	// (prefetch 1, so `next` stays queued) and closes its channel.
	raw := dialRaw(t, v.URL)
	for i := 0; i < limit; i++ {
		ch, err := raw.conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		_ = ch.Qos(1, 0, false)
		ds, err := ch.Consume(c.QueueName(), "", false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-ds:
			if m.MessageId != first.ID {
				t.Fatalf("delivery %d: message %s, want the first event", i+1, m.MessageId)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("delivery %d: nothing delivered", i+1)
		}
		_ = ch.Close()
	}

	// Its last delivery goes to a runner that dies on it too: the side
	// effect never returns, and its connection is cut.
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (n bigserial PRIMARY KEY, event_id uuid)`); err != nil {
		t.Fatal(err)
	}
	running, die := make(chan struct{}, 1), make(chan struct{})
	run := func(cfg amqp.Config, pool *pgxpool.Pool) {
		r, err := amqp.NewRunner(cfg, pool, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
			if e.ID == first.ID {
				select {
				case running <- struct{}{}:
				default:
				}
				<-die
				return errors.New("the consumer process died")
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied (event_id) VALUES ($1)`, e.ID)
			return err
		}, inbox.ConsumerConfig{Consumer: c.Name, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = r.Run(rctx) }()
		t.Cleanup(func() { cancel(); <-done })
	}
	// The dying runner reaches RabbitMQ and PostgreSQL through proxies the
	// test cuts, as the process's death would.
	proxied := func(raw string) (string, *transporttest.Proxy) {
		u, err := url.Parse(raw)
		if err != nil {
			t.Fatal(err)
		}
		px := transporttest.NewProxy(t, u.Host)
		u.Host = px.Addr()
		return u.String(), px
	}
	dying := cfg
	var amqpPx, pgPx *transporttest.Proxy
	dying.URL, amqpPx = proxied(v.URL)
	pgURL, pgPx := proxied(db.URL)
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	run(dying, pool)
	t.Cleanup(sync.OnceFunc(func() { close(die) })) // runs first: the dead runner can then stop
	select {
	case <-running:
	case <-time.After(20 * time.Second):
		t.Fatal("the first event's last delivery never ran")
	}
	var held int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_held WHERE group_id = 'd-1'`).Scan(&held); err != nil || held != 1 {
		t.Errorf("before its last delivery ran, the group had %d held rows (%v), want 1", held, err)
	}
	if amqpPx.Cut() == 0 || pgPx.Cut() == 0 {
		t.Fatal("no connection to cut")
	}
	run(cfg, db.Pool) // the consumer restarted

	// The broker dead-letters `first` (delivery_limit); `next` comes to the
	// runner again and must wait: to the DLQ behind it, not applied.
	dlq := c.DLQName()
	var applied int
	// Without the hold the next event would wait behind the dead runner's
	// park of `first` until inbox.ParkGrace (15m), then be applied first.
	eventually(t, 15*time.Second, "both events in the DLQ (the next one held behind the first), or the next one applied", func() bool {
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&applied)
		return raw.depth(dlq) >= 2 || applied > 0
	})
	time.Sleep(300 * time.Millisecond)
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&applied); err != nil || applied != 0 {
		t.Fatalf("%d events applied (%v): the next event overtook the dead-lettered one", applied, err)
	}
	got := raw.get(dlq)
	seen := map[string]bool{}
	var limitDeath bool
	for _, m := range got {
		seen[m.MessageId] = true
		if m.MessageId == first.ID {
			if deaths, _ := m.Headers["x-death"].([]any); len(deaths) > 0 {
				if d, _ := deaths[0].(amqp091.Table); d["reason"] == "delivery_limit" {
					limitDeath = true
				}
			}
		}
	}
	if !seen[first.ID] || !seen[next.ID] {
		t.Fatalf("DLQ holds %d messages without both events", len(got))
	}
	if !limitDeath {
		t.Errorf("the first event was not dead-lettered by the broker's delivery limit (the test proves nothing)")
	}
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_held WHERE group_id = 'd-1'`).Scan(&held); err != nil || held != 2 {
		t.Errorf("the group has %d held rows (%v), want 2 (the dead one and the one behind it)", held, err)
	}
}
