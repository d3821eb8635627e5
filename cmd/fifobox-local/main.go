// Command fifobox-local runs the fifobox pipeline locally against PostgreSQL
// and the SNS/SQS emulator (or LocalStack/Floci via AWS_ENDPOINT_URL):
// migrate, create the topology, run the dispatcher and a demo producer, and
// show events arriving in order in every queue. `make local` runs it.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/localdemo"
	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/lambdafn/consumer"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/snspub"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/topology/provision"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/nats"
)

func main() {
	dbURL := flag.String("database-url", envOr("FIFOBOX_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fifobox?sslmode=disable"), "PostgreSQL connection string (env FIFOBOX_DATABASE_URL)")
	orders := flag.Int("orders", 300, "orders to create (three events each)")
	rate := flag.Int("rate", 200, "business transactions per second")
	period := flag.Duration("schedule", 10*time.Second, "how often the local scheduler invokes the dispatcher handler")
	metricsPath := flag.String("metrics-log", ".data/metrics.emf.jsonl", "file for the functions' EMF metric lines")
	flag.Parse()

	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	slog.SetDefault(log)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fi, _ := os.Stdout.Stat()
	opts := options{dbURL: *dbURL, orders: *orders, rate: *rate, period: *period, metricsPath: *metricsPath,
		out: os.Stdout, interactive: fi != nil && fi.Mode()&os.ModeCharDevice != 0}
	if err := run(ctx, opts, log); err != nil {
		fmt.Fprintln(os.Stderr, "fifobox-local:", err)
		os.Exit(1)
	}
}

// options of one run; main fills them from the flags.
type options struct {
	dbURL          string
	orders, rate   int
	period         time.Duration
	metricsPath    string
	out            io.Writer
	interactive    bool   // redraw the progress line in place (a terminal)
	topologyPrefix string // prepended to topic and queue names (tests run side by side)
}

func run(ctx context.Context, o options, log *slog.Logger) error {
	kind, err := transport.KindFromEnv()
	if err != nil {
		return err
	}
	if kind == transport.SNS && os.Getenv("AWS_ENDPOINT_URL") == "" {
		return fmt.Errorf("AWS_ENDPOINT_URL is not set: source localstack/env.sh (make local does)")
	}
	// pkg/db is what the Lambdas use: the same query mode as through RDS Proxy.
	pool, err := db.Open(ctx, db.Config{URL: o.dbURL, MaxConns: 16}, nil)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	if kind != transport.SNS {
		return runBroker(ctx, o, log, pool, kind)
	}
	cfg, err := awsclient.Load(ctx)
	if err != nil {
		return err
	}
	snsc, sqsc := awsclient.SNS(cfg), awsclient.SQS(cfg)
	topo := topology.Default()
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	res, err := provision.Provision(pctx, snsc, sqsc, topo, provision.Options{Prefix: o.topologyPrefix, VisibilityTimeoutSeconds: 30})
	cancel()
	if err != nil {
		return fmt.Errorf("create topology at %s: %w", os.Getenv("AWS_ENDPOINT_URL"), err)
	}
	fmt.Fprintf(o.out, "topology: topic %s\n", res.TopicARN)
	for _, c := range topo.Consumers {
		q := res.Queues[c.Name]
		filter := c.FilterPolicy()
		if filter == "" {
			filter = "(all events)"
		}
		fmt.Fprintf(o.out, "  queue %-26s filter %-34s DLQ %s after %d receives\n", q.Name, filter, c.DLQName(), c.MaxReceiveCount)
	}
	sns, err := snspub.New(snsc, snspub.Config{TopicARN: res.TopicARN})
	if err != nil {
		return err
	}
	// The functions' EMF metric lines go to a file here (CloudWatch Logs in AWS).
	if err := os.MkdirAll(filepath.Dir(o.metricsPath), 0o755); err != nil {
		return err
	}
	mf, err := os.Create(o.metricsPath)
	if err != nil {
		return fmt.Errorf("metrics log: %w", err)
	}
	defer mf.Close()
	em := metrics.New(mf, "")

	// The real function handlers, built as the Lambdas' main.go build them.
	var published atomic.Int64
	counting := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		errs := sns.Publish(ctx, msgs)
		for _, err := range errs {
			if err == nil {
				published.Add(1)
			}
		}
		return errs
	})
	dh, err := dispatcher.New(pool, counting, em, dispatcher.Config{Logger: log})
	if err != nil {
		return err
	}
	consumers := map[string]inbox.BatchFunc{}
	for name, q := range res.Queues {
		h, err := consumer.New(pool, sqsc, readmodel.ForConsumer(name), em, consumer.Config{Consumer: name, DLQURL: q.DLQURL, Logger: log})
		if err != nil {
			return err
		}
		consumers[name] = h.Handle
	}
	fmt.Fprintf(o.out, "demo: %d orders (created, paid, shipped; one transaction per step) at %d tx/s\n", o.orders, o.rate)
	fmt.Fprintf(o.out, "functions: dispatcher handler invoked every %s (deadline %s); consumer handlers fed by local SQS event-source runners\n",
		o.period, o.period+5*time.Second)
	fmt.Fprintf(o.out, "metrics: EMF lines in %s\n\n", o.metricsPath)
	return localdemo.Run(ctx, localdemo.Config{Orders: o.orders, Rate: o.rate, SchedulePeriod: o.period, Out: o.out, Interactive: o.interactive},
		localdemo.Deps{Pool: pool, SQS: sqsc, Resources: res, Published: &published, Consumers: consumers, Log: log,
			Dispatch: func(ctx context.Context) (dispatcher.Result, error) { return dh.Handle(ctx, nil) }})
}

// runBroker is the demo through RabbitMQ or NATS JetStream: the default
// topology's consumers (orders-projection, shipping, audit) as that
// broker's queues or stream consumers, the dispatcher Lambda's handler
// publishing through its publisher, and its consumer runners applying the
// read model through the inbox.
func runBroker(ctx context.Context, o options, log *slog.Logger, pool *pgxpool.Pool, kind transport.Kind) error {
	var (
		t    transport.Transport
		desc string
		err  error
	)
	switch kind {
	case transport.RabbitMQ:
		if v := os.Getenv("FIFOBOX_AMQP_TOPOLOGY"); v != "" && v != "default" {
			return fmt.Errorf("FIFOBOX_AMQP_TOPOLOGY=%s: make local runs the default topology (the demo's consumers)", v)
		}
		cfg, err := amqp.ConfigFromEnv()
		if err != nil {
			return err
		}
		cfg.Logger = log
		desc = fmt.Sprintf("RabbitMQ %s, exchange %s", redactedHost(cfg.URL), cfg.Topology.Exchange.Name)
		if t, err = amqp.New(cfg); err != nil {
			return err
		}
	case transport.NATS:
		if v := os.Getenv("FIFOBOX_NATS_TOPOLOGY"); v != "" && v != "default" {
			return fmt.Errorf("FIFOBOX_NATS_TOPOLOGY=%s: make local runs the default topology (the demo's consumers)", v)
		}
		cfg, err := nats.ConfigFromEnv()
		if err != nil {
			return err
		}
		cfg.Logger = log
		desc = fmt.Sprintf("NATS JetStream %s, stream %s, subjects %s.>", redactedHost(cfg.URL), cfg.Topology.Stream, cfg.Topology.SubjectPrefix)
		if t, err = nats.New(cfg); err != nil {
			return err
		}
	default:
		return fmt.Errorf("%s=%s: make local knows sns, rabbitmq and nats", transport.EnvTransport, kind)
	}
	defer t.Close()
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = t.Provisioner().Provision(pctx)
	cancel()
	if err != nil {
		return fmt.Errorf("create topology on %s: %w", desc, err)
	}
	topo := topology.Default()
	fmt.Fprintf(o.out, "topology: %s\n", desc)
	for _, c := range topo.Consumers {
		filter := c.FilterPolicy()
		if filter == "" {
			filter = "(all events)"
		}
		fmt.Fprintf(o.out, "  consumer %-20s filter %s\n", c.Name, filter)
	}
	if err := os.MkdirAll(filepath.Dir(o.metricsPath), 0o755); err != nil {
		return err
	}
	mf, err := os.Create(o.metricsPath)
	if err != nil {
		return fmt.Errorf("metrics log: %w", err)
	}
	defer mf.Close()
	em := metrics.New(mf, "")
	var published atomic.Int64
	pub := t.Publisher()
	counting := outbox.PublisherFunc(func(ctx context.Context, msgs []outbox.Message) []error {
		errs := pub.Publish(ctx, msgs)
		for _, err := range errs {
			if err == nil {
				published.Add(1)
			}
		}
		return errs
	})
	dh, err := dispatcher.New(pool, counting, em, dispatcher.Config{Logger: log})
	if err != nil {
		return err
	}
	fmt.Fprintf(o.out, "demo: %d orders (created, paid, shipped; one transaction per step) at %d tx/s\n", o.orders, o.rate)
	fmt.Fprintf(o.out, "functions: dispatcher handler invoked every %s (deadline %s); consumers: %s runners (inbox + read model)\n",
		o.period, o.period+5*time.Second, kind)
	fmt.Fprintf(o.out, "metrics: EMF lines in %s\n\n", o.metricsPath)
	return localdemo.Run(ctx, localdemo.Config{Orders: o.orders, Rate: o.rate, SchedulePeriod: o.period, Out: o.out, Interactive: o.interactive},
		localdemo.Deps{Pool: pool, Published: &published, Log: log, Topology: topo,
			Dispatch: func(ctx context.Context) (dispatcher.Result, error) { return dh.Handle(ctx, nil) },
			Runner: func(name string, applied func(envelope.Envelope)) (transport.Runner, error) {
				apply := readmodel.ForConsumer(name)
				return t.Consumer(name, pool, func(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
					if err := apply(ctx, tx, e); err != nil {
						return err
					}
					applied(e)
					return nil
				})
			}})
}

// redactedHost is a broker URL's scheme and host, for output without credentials.
func redactedHost(u string) string {
	first, _, _ := strings.Cut(u, ",")
	if p, err := url.Parse(first); err == nil && p.Host != "" {
		return p.Scheme + "://" + p.Host
	}
	return "(broker)"
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
