package nats_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/internal/proccpu"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// brokerProcess is the NATS server's process name, whose CPU the benchmark
// reports when the server runs on this machine.
const brokerProcess = "nats-server"

const (
	benchConcurrency = 16 // the dispatcher's default PublishConcurrency
	benchBatch       = 10 // the dispatcher's default PublishBatchSize
)

// benchEvents: the events every transport's throughput benchmark publishes.
var benchEvents = transporttest.BenchEvents

// BenchmarkThroughNATS measures dispatcher throughput (PostgreSQL outbox ->
// Publisher -> holdco's stream with its 3 durable consumers) beside the raw
// JetStream publish rate of the same client to the same stream, with the
// same messages, headers, batch size and concurrency, in one run: 16
// goroutines, each publishing 10 messages asynchronously and then waiting
// for their 10 PubAcks. Rounds alternate which side goes first; the best of
// each is reported. b.N is events per round.
//
//	go test -run '^$' -bench BenchmarkThroughNATS -benchtime 20000x ./pkg/transport/nats/
func BenchmarkThroughNATS(b *testing.B) {
	cfg := setup(b, nats.Holdco())
	if err := cfg.Topology.Prepare(); err != nil {
		b.Fatal(err)
	}
	var raw, disp, pubOnly, instant proccpu.Cost
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
		b.Run("raw-jetstream-publish", func(b *testing.B) {
			msgs := make([]outbox.Message, b.N)
			for i, e := range benchEvents(b.N) {
				msgs[i] = message(e)
			}
			b.ResetTimer()
			c := proccpu.Measure(b.N, func() float64 { return rawRound(b, cfg, msgs) }, brokerProcess)
			b.StopTimer()
			purge(b, cfg)
			best(&raw, c)
			b.ReportMetric(c.Rate, "msgs/s")
		})
	}
	pubSide := func() {
		// The Publisher driven exactly like the raw side, without the outbox:
		// what the transport costs on its own.
		b.Run("publisher", func(b *testing.B) {
			msgs := make([]outbox.Message, b.N)
			for i, e := range benchEvents(b.N) {
				msgs[i] = message(e)
			}
			pub, err := nats.NewPublisher(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			if err := pub.Publish(context.Background(), msgs[:1])[0]; err != nil { // connect outside the timing
				b.Fatal(err)
			}
			b.ResetTimer()
			c := proccpu.Measure(b.N-1, func() float64 {
				r, err := outboxtest.Drive(context.Background(), pub, msgs[1:], benchConcurrency, benchBatch)
				if err != nil {
					b.Fatal(err)
				}
				return r
			}, brokerProcess)
			b.StopTimer()
			purge(b, cfg)
			best(&pubOnly, c)
			b.ReportMetric(c.Rate, "msgs/s")
		})
	}
	for round := 1; round <= rounds; round++ {
		if round%2 == 1 {
			rawSide()
			pubSide()
		}
		best(&disp, dispatchRound(b, "dispatcher", cfg, nil))
		// The same drain with a publisher that returns at once: the ceiling
		// the outbox itself (PostgreSQL on this machine) sets.
		best(&instant, dispatchRound(b, "dispatcher-instant-publisher", cfg,
			outbox.PublisherFunc(func(_ context.Context, msgs []outbox.Message) []error { return make([]error, len(msgs)) })))
		if round%2 == 0 {
			pubSide()
			rawSide()
		}
	}
	if raw.Rate > 0 && disp.Rate > 0 {
		fmt.Printf("\nthrough NATS JetStream (holdco: one stream, 3 durable pull consumers; best of %d rounds)\n", rounds)
		outboxtest.Report(os.Stdout, "nats-server", brokerProcess, []outboxtest.CostRow{
			{Name: "raw JetStream publish (10 async/batch, 16 workers)", Cost: raw},
			{Name: "nats.Publisher alone (same batches, no outbox)", Cost: pubOnly},
			{Name: "dispatcher: outbox -> JetStream (Drain)", Cost: disp},
			{Name: "dispatcher, instant publisher (the outbox alone)", Cost: instant},
		}, raw.Rate, disp.Rate, instant.Rate)
		fmt.Printf("publisher / raw %.0f%%\n\n", 100*pubOnly.Rate/raw.Rate)
	}
}

// rawRound publishes msgs like the dispatcher's publish step would, with the
// client alone: benchConcurrency goroutines, each taking the next 10
// messages, publishing them asynchronously and waiting for their PubAcks.
func rawRound(b *testing.B, cfg nats.Config, msgs []outbox.Message) float64 {
	nc, err := natsgo.Connect(cfg.URL)
	if err != nil {
		b.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		b.Fatal(err)
	}
	out := make([]*natsgo.Msg, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		out[i] = &natsgo.Msg{Subject: cfg.Topology.EventSubject(m), Data: m.Body, Header: natsgo.Header{
			nats.HeaderMsgID: {m.EventID}, nats.HeaderEventID: {m.EventID}, nats.HeaderEventType: {m.EventType},
			nats.HeaderAggregateType: {m.AggregateType}, nats.HeaderAggregateID: {m.GroupID},
			nats.HeaderSequence: {strconv.FormatInt(m.Sequence, 10)}, nats.HeaderTenantID: {"acme"},
			nats.HeaderContentType: {"application/json"}}}
	}
	var next sync.Mutex
	pos := 0
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < benchConcurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			futs := make([]jetstream.PubAckFuture, 0, benchBatch)
			for {
				next.Lock()
				lo := pos
				pos = min(pos+benchBatch, len(out))
				hi := pos
				next.Unlock()
				if lo >= hi {
					return
				}
				futs = futs[:0]
				for i := lo; i < hi; i++ {
					f, err := js.PublishMsgAsync(out[i], jetstream.WithExpectStream(cfg.Topology.Stream))
					if err != nil {
						b.Error(err)
						return
					}
					futs = append(futs, f)
				}
				for _, f := range futs {
					select {
					case <-f.Ok():
					case err := <-f.Err():
						b.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	return float64(len(msgs)) / time.Since(start).Seconds()
}

// dispatchRound drains b.N enqueued events through pub (nil: a nats
// Publisher) and returns the rate.
func dispatchRound(b *testing.B, name string, cfg nats.Config, pub outbox.Publisher) proccpu.Cost {
	var cost proccpu.Cost
	b.Run(name, func(b *testing.B) {
		db := pgtest.New(b)
		evs := benchEvents(b.N)
		p := pub
		if p == nil {
			np, err := nats.NewPublisher(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer np.Close()
			p = np
		}
		b.ResetTimer()
		var err error
		cost, err = outboxtest.DrainRate(context.Background(), db.Pool, evs, p,
			outbox.DispatcherConfig{PublishConcurrency: benchConcurrency, PublishBatchSize: benchBatch, Logger: quiet}, brokerProcess)
		b.StopTimer()
		if err != nil {
			b.Fatal(err)
		}
		purge(b, cfg)
		b.ReportMetric(cost.Rate, "events/s")
	})
	return cost
}

// purge empties the stream between rounds, so no round pays for another's
// backlog.
func purge(b *testing.B, cfg nats.Config) {
	r := dialRaw(b)
	s, err := r.js.Stream(context.Background(), cfg.Topology.Stream)
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Purge(context.Background()); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkLatency is RabbitMQ's BenchmarkLatency on JetStream: 100 and
// 1,000 events/s offered (one business transaction each, over 500
// aggregates) for FIFOBOX_BENCH_SECONDS (default 30) to the whole pipeline
// (dispatcher with its defaults, holdco's three consumers applying through
// the inbox, a lane's waiting messages in one transaction), reporting
// commit-to-consume latency beside the RabbitMQ figure.
//
//	go test -run '^$' -bench BenchmarkLatency -benchtime 1x ./pkg/transport/nats/
func BenchmarkLatency(b *testing.B) {
	needServer(b)
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
	cfg := setup(b, nats.Holdco())
	if err := cfg.Topology.Prepare(); err != nil {
		b.Fatal(err)
	}
	topo := cfg.Topology
	pub := newPublisher(b, cfg)
	lanes := map[string]int{}
	for _, c := range topo.Consumers {
		lanes[c.Name] = c.Workers
	}
	routes := routes(topo)
	evs := make([]envelope.Envelope, rate*seconds)
	for i := range evs {
		k := transporttest.Holdco.Kinds[i%len(transporttest.Holdco.Kinds)]
		evs[i] = newEvent(k.Type, fmt.Sprintf("%s-%04d", k.Type, i%500), k.Events[(i/500)%len(k.Events)], 0)
	}
	transporttest.LatencyRun{DB: pgtest.New(b), Publisher: pub, Consumers: lanes,
		Runner: func(name string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error) {
			return nats.NewRunner(cfg, db, apply, cc)
		},
		Events: evs, Routes: func(e envelope.Envelope) int { return len(routes(e)) }, Rate: rate, BrokerProcess: brokerProcess,
	}.Measure(b)
}
