package transport

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/metrics"
)

// SecretFunc returns a secret's string value; on AWS, Secrets Manager's
// (pkg/lambdafn.SecretsManager).
type SecretFunc func(ctx context.Context, arn string) (string, error)

// Options are what Open hands the chosen transport besides its
// environment variables.
type Options struct {
	// Logger for the transport's connections, runners and handlers;
	// default slog.Default().
	Logger *slog.Logger
	// Secret reads the secret a transport's *_SECRET_ARN variable names
	// (the Lambdas pass Secrets Manager). Nil: such a variable is an error.
	Secret SecretFunc
	// Local marks a development run against local services (make local):
	// a transport may shorten its timeouts and retry delays there, so a
	// failed message comes back in seconds rather than minutes.
	Local bool
}

// Opener is one transport's way in: the variables it reads and how it opens
// from them. Each transport package registers its Opener (Register) in an
// init function; a program links the transports it supports by importing
// their packages (the Lambdas, the CLI and make local import all three).
type Opener struct {
	// Env declares every variable Open reads (pkg/envspec), besides
	// FIFOBOX_TRANSPORT.
	Env envspec.Set
	// Open reads Env and returns the transport; it does not have to
	// connect yet. Errors name the variable at fault and never carry a
	// secret.
	Open func(ctx context.Context, o Options) (Transport, error)
}

var (
	regMu    sync.RWMutex
	registry = map[Kind]Opener{}
)

// Register makes a transport available to Open. It panics if kind is
// registered twice or the opener has no Open.
func Register(kind Kind, o Opener) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := registry[kind]; dup {
		panic(fmt.Sprintf("transport: %s registered twice", kind))
	}
	if o.Open == nil {
		panic(fmt.Sprintf("transport: %s registered without Open", kind))
	}
	registry[kind] = o
}

// registered returns the registered kinds, sorted.
func registered() []Kind {
	kinds := make([]Kind, 0, len(registry))
	for k := range registry {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool { return kinds[i] < kinds[j] })
	return kinds
}

// RegisteredEnv is every variable Open may read: FIFOBOX_TRANSPORT and
// each registered transport's own (the Lambdas' runtime contract tests
// check deployments against it).
func RegisteredEnv() envspec.Set {
	regMu.RLock()
	defer regMu.RUnlock()
	sets := []envspec.Set{Env}
	for _, k := range registered() {
		sets = append(sets, registry[k].Env)
	}
	return envspec.Join(sets...)
}

// Open opens the transport FIFOBOX_TRANSPORT names (default sns) from its
// environment variables: the one constructor the Lambdas, the CLI and
// make local share. A variable only another transport reads is refused, so
// a deployment that mixes two transports' settings fails at start, naming
// it.
func Open(ctx context.Context, o Options) (Transport, error) {
	kind, err := KindFromEnv()
	if err != nil {
		return nil, err
	}
	regMu.RLock()
	op, ok := registry[kind]
	var others []envspec.Set
	for _, k := range registered() {
		if k != kind {
			others = append(others, registry[k].Env)
		}
	}
	regMu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%s=%s: this program was built without that transport", EnvTransport, kind)
	}
	own := envspec.Join(Env, op.Env)
	for _, set := range others {
		for _, v := range set {
			if _, mine := own.Lookup(v.Name); mine || set.Get(v.Name) == "" {
				continue
			}
			return nil, fmt.Errorf("%s is set, but %s=%s does not read it (another transport's setting): remove it, or set %s to its transport",
				v.Name, EnvTransport, kind, EnvTransport)
		}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	t, err := op.Open(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("open %s transport: %w", kind, err)
	}
	return t, nil
}

// LambdaConsumer is a Transport that AWS Lambda has an event source for
// (SNS/SQS: the SQS FIFO event source; RabbitMQ: Amazon MQ's). NATS has
// none: its consumers run Transport.Consumer as a long-running process.
type LambdaConsumer interface {
	// LambdaHandler returns the consumer function's handler, for
	// lambda.Start.
	LambdaHandler(cfg LambdaConfig) (any, error)
}

// LambdaConfig is what a consumer function's handler needs besides the
// transport's own settings.
type LambdaConfig struct {
	// Consumer is the consumer's name: inbox key and metric dimension.
	Consumer string
	// DB holds the inbox; Apply is the side effect.
	DB    inbox.DB
	Apply inbox.Apply
	// DeadlineMargin: no record starts this close to the invocation's
	// deadline. 0: the handler's default.
	DeadlineMargin time.Duration
	// LogAggregateIDs adds aggregate ids to log lines (they may carry
	// personal data).
	LogAggregateIDs bool
	// Metrics receives the handler's EMF lines; nil: none.
	Metrics *metrics.Emitter
	// Logger; default slog.Default().
	Logger *slog.Logger
}
