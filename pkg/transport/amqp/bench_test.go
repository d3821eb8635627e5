package amqp_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/internal/proccpu"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// brokerProcess is the RabbitMQ server's process name (the Erlang VM), whose
// CPU the benchmark reports when the broker runs on this machine.
const brokerProcess = "beam.smp"

const (
	benchConcurrency = 16 // the dispatcher's default PublishConcurrency
	benchBatch       = 10 // the dispatcher's default PublishBatchSize
)

// benchEvents: the events every transport's throughput benchmark publishes.
var benchEvents = transporttest.BenchEvents

// BenchmarkThroughRabbitMQ measures dispatcher throughput (PostgreSQL outbox
// -> Publisher -> holdco's topic exchange and 3 quorum queues) beside the raw
// publish-with-confirms rate of the same client to the same exchange, with
// the same messages, batch size and concurrency, in one run: 16 goroutines,
// each on its own confirm channel publishing 10 messages and then waiting
// for their 10 confirms. Rounds alternate which side goes first; the best of
// each is reported. b.N is events per round.
//
//	go test -run '^$' -bench BenchmarkThroughRabbitMQ -benchtime 20000x ./pkg/transport/amqp/
func BenchmarkThroughRabbitMQ(b *testing.B) {
	topo := amqp.Holdco()
	v, cfg := benchVhost(b, topo)
	var raw, alone, disp, instant proccpu.Cost
	best := func(c *proccpu.Cost, n proccpu.Cost) {
		if n.Rate > c.Rate {
			*c = n
		}
	}
	rounds := 2
	if s := os.Getenv("FIFOBOX_BENCH_ROUNDS"); s != "" {
		rounds, _ = strconv.Atoi(s)
	}
	rawSide := func() {
		b.Run("raw-publish-confirm", func(b *testing.B) {
			msgs := make([]outbox.Message, b.N)
			for i, e := range benchEvents(b.N) {
				msgs[i] = message(e)
			}
			b.ResetTimer()
			c := proccpu.Measure(b.N, func() float64 { return rawRound(b, v.URL, cfg.Topology, msgs) }, brokerProcess)
			b.StopTimer()
			purge(b, v.URL, topo)
			best(&raw, c)
			b.ReportMetric(c.Rate, "msgs/s")
		})
	}
	// The Publisher alone, driven as the dispatcher drives it (16 callers,
	// 10 messages each), without the outbox: what the transport costs over
	// the raw client.
	aloneSide := func() {
		b.Run("publisher-alone", func(b *testing.B) {
			msgs := make([]outbox.Message, b.N)
			for i, e := range benchEvents(b.N) {
				msgs[i] = message(e)
			}
			pub, err := amqp.NewPublisher(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			b.ResetTimer()
			c := proccpu.Measure(b.N, func() float64 {
				r, err := outboxtest.Drive(context.Background(), pub, msgs, benchConcurrency, benchBatch)
				if err != nil {
					b.Fatal(err)
				}
				return r
			}, brokerProcess)
			b.StopTimer()
			purge(b, v.URL, topo)
			best(&alone, c)
			b.ReportMetric(c.Rate, "msgs/s")
		})
	}
	for round := 1; round <= rounds; round++ {
		if round%2 == 1 {
			rawSide()
			aloneSide()
		}
		best(&disp, dispatchRound(b, "dispatcher", v.URL, cfg, nil))
		// The same drain with a publisher that returns at once: what the
		// outbox (PostgreSQL on this machine) costs on its own.
		best(&instant, dispatchRound(b, "dispatcher-instant-publisher", v.URL, cfg,
			outbox.PublisherFunc(func(_ context.Context, msgs []outbox.Message) []error { return make([]error, len(msgs)) })))
		if round%2 == 0 {
			aloneSide()
			rawSide()
		}
	}
	if raw.Rate > 0 && disp.Rate > 0 {
		fmt.Printf("\nthrough RabbitMQ (holdco: topic exchange, 3 quorum queues; best of %d rounds)\n", rounds)
		outboxtest.Report(os.Stdout, "RabbitMQ", brokerProcess, []outboxtest.CostRow{
			{Name: "raw publish with confirms (10/batch, 16 channels)", Cost: raw},
			{Name: "amqp.Publisher alone (same batches, no outbox)", Cost: alone},
			{Name: "dispatcher: outbox -> RabbitMQ (Drain)", Cost: disp},
			{Name: "dispatcher, instant publisher (the outbox alone)", Cost: instant},
		}, raw.Rate, disp.Rate, instant.Rate)
		fmt.Printf("publisher / raw %.0f%%\n\n", 100*alone.Rate/raw.Rate)
	}
}

// dispatchRound drains b.N enqueued events through pub (nil: an
// amqp.Publisher) and returns the rate and what the drain used.
func dispatchRound(b *testing.B, name, url string, cfg amqp.Config, pub outbox.Publisher) proccpu.Cost {
	var cost proccpu.Cost
	b.Run(name, func(b *testing.B) {
		db := pgtest.New(b)
		evs := benchEvents(b.N)
		p := pub
		if p == nil {
			ap, err := amqp.NewPublisher(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer ap.Close()
			p = ap
		}
		b.ResetTimer()
		var err error
		cost, err = outboxtest.DrainRate(context.Background(), db.Pool, evs, p,
			outbox.DispatcherConfig{PublishConcurrency: benchConcurrency, PublishBatchSize: benchBatch, Logger: quiet}, brokerProcess)
		b.StopTimer()
		if err != nil {
			b.Fatal(err)
		}
		if pub == nil {
			purge(b, url, cfg.Topology)
		}
		b.ReportMetric(cost.Rate, "events/s")
	})
	return cost
}

// rawRound publishes msgs like the dispatcher's publish step would, with
// the client alone: benchConcurrency channels in confirm mode, each taking
// the next 10 messages, publishing them and waiting for their confirms.
func rawRound(b *testing.B, url string, topo amqp.Topology, msgs []outbox.Message) float64 {
	conn, err := amqp091.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	keys := make([]string, len(msgs))
	pubs := make([]amqp091.Publishing, len(msgs))
	for i, m := range msgs {
		keys[i] = m.AggregateType + "." + m.EventType
		pubs[i] = amqp091.Publishing{Headers: amqp091.Table{"x-event-id": m.EventID, "x-aggregate-type": m.AggregateType,
			"x-aggregate-id": m.GroupID, "x-event-type": m.EventType, "x-tenant-id": "acme", "x-attempts": int32(0)},
			ContentType: "application/json", DeliveryMode: amqp091.Persistent, MessageId: m.EventID, Type: m.EventType,
			Timestamp: time.Now(), AppId: "fifobox", Body: m.Body}
	}
	var next sync.Mutex
	pos := 0
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < benchConcurrency; w++ {
		ch, err := conn.Channel()
		if err != nil {
			b.Fatal(err)
		}
		if err := ch.Confirm(false); err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer ch.Close()
			dcs := make([]*amqp091.DeferredConfirmation, 0, benchBatch)
			for {
				next.Lock()
				lo := pos
				pos = min(pos+benchBatch, len(msgs))
				hi := pos
				next.Unlock()
				if lo >= hi {
					return
				}
				dcs = dcs[:0]
				for i := lo; i < hi; i++ {
					dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), topo.Exchange.Name, keys[i], true, false, pubs[i])
					if err != nil {
						b.Error(err)
						return
					}
					dcs = append(dcs, dc)
				}
				for _, dc := range dcs {
					if !dc.Wait() {
						b.Error("nacked")
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	return float64(len(msgs)) / time.Since(start).Seconds()
}

// BenchmarkLatency offers 100 and 1,000 events/s (one business transaction
// each, over 500 aggregates) for FIFOBOX_BENCH_SECONDS (default 30) to the
// whole pipeline (dispatcher with its defaults, holdco's three consumers
// applying through the inbox) and reports commit-to-consume latency: from
// the producer's COMMIT returning to a consumer's inbox transaction having
// committed the event (every consumer's application is one sample).
//
//	go test -run '^$' -bench BenchmarkLatency -benchtime 1x ./pkg/transport/amqp/
func BenchmarkLatency(b *testing.B) {
	// 30 s: in a 10 s run the first second (connections opening, the
	// dispatcher's first claims, cold plans) weighs on p99 as much as the
	// steady state does; every sample still counts, the start included.
	seconds := 30
	if v, err := strconv.Atoi(os.Getenv("FIFOBOX_BENCH_SECONDS")); err == nil && v > 0 {
		seconds = v
	}
	for _, rate := range []int{100, 1000} {
		b.Run(fmt.Sprintf("%d-per-second", rate), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				latencyRun(b, rate, seconds)
			}
		})
	}
}

func latencyRun(b *testing.B, rate, seconds int) {
	topo := amqp.Holdco()
	_, cfg := benchVhost(b, topo)
	pub, err := amqp.NewPublisher(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	lanes := map[string]int{}
	for _, c := range topo.Consumers {
		lanes[c.Name] = max(c.Workers, 8)
	}
	routes := routes(topo)
	evs := make([]envelope.Envelope, rate*seconds)
	for i := range evs {
		k := transporttest.Holdco.Kinds[i%len(transporttest.Holdco.Kinds)]
		evs[i] = newEvent(k.Type, fmt.Sprintf("%s-%04d", k.Type, i%500), k.Events[(i/500)%len(k.Events)], 0)
	}
	transporttest.LatencyRun{DB: pgtest.New(b), Publisher: pub, Consumers: lanes,
		Runner: func(name string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error) {
			return amqp.NewRunner(cfg, db, apply, cc)
		},
		Events: evs, Routes: func(e envelope.Envelope) int { return len(routes(e)) }, Rate: rate, BrokerProcess: brokerProcess,
	}.Measure(b)
}

// benchVhost is setup for benchmarks.
func benchVhost(b *testing.B, topo amqp.Topology) (*amqptest.Vhost, amqp.Config) {
	b.Helper()
	v := amqptest.New(b)
	cfg := amqp.Config{URL: v.URL, Topology: topo, Logger: quiet}
	p, err := amqp.NewProvisioner(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := p.Provision(context.Background()); err != nil {
		b.Fatal(err)
	}
	return v, cfg
}

// purge empties the topology's queues between rounds, so no round pays for
// another's backlog.
func purge(b *testing.B, url string, topo amqp.Topology) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	defer ch.Close()
	for _, c := range topo.Consumers {
		if _, err := ch.QueuePurge(c.QueueName(), false); err != nil {
			b.Fatal(err)
		}
	}
}
