package nats

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/redact"
	"github.com/fifobox/fifobox/pkg/wire"
)

// Environment variables read by ConfigFromEnv.
const (
	EnvURL           = "FIFOBOX_NATS_URL"
	EnvTopology      = "FIFOBOX_NATS_TOPOLOGY"
	EnvStream        = "FIFOBOX_NATS_STREAM"
	EnvSubjectPrefix = "FIFOBOX_NATS_SUBJECT_PREFIX"
	EnvSubject       = "FIFOBOX_NATS_SUBJECT"
	EnvCredsFile     = "FIFOBOX_NATS_CREDS"
	EnvUser          = "FIFOBOX_NATS_USER"
	EnvPassword      = "FIFOBOX_NATS_PASSWORD"
	EnvPingInterval  = "FIFOBOX_NATS_PING_INTERVAL"
	// EnvLogAggregateIDs is read by Transport.Consumer.
	EnvLogAggregateIDs = "FIFOBOX_LOG_AGGREGATE_IDS"
)

// DefaultURL is the local server.
const DefaultURL = "nats://127.0.0.1:4222"

// Env declares the variables ConfigFromEnv reads (pkg/envspec: the Lambdas'
// runtime contract tests check every read against the deployment).
var Env = envspec.Set{
	{Name: EnvURL, Doc: "NATS server URL(s), comma-separated (default " + DefaultURL + "); tls:// for TLS"},
	{Name: EnvTopology, Doc: "built-in topology (default, holdco, ticketing, corewrite), a JSON file, or the JSON itself (default: default)"},
	{Name: EnvStream, Doc: "overrides the topology's stream name"},
	{Name: EnvSubjectPrefix, Doc: "overrides the topology's subject prefix"},
	{Name: EnvSubject, Doc: "overrides the topology's subject template, e.g. {aggregate_type}.{event_type}"},
	{Name: EnvCredsFile, Doc: "optional NATS credentials file (JWT + NKey seed)"},
	{Name: EnvUser, Doc: "optional user name (with " + EnvPassword + ")"},
	{Name: EnvPassword, Doc: "optional password"},
	{Name: EnvPingInterval, Doc: "how often a connection pings the server; two unanswered pings drop it (default 5s)"},
	{Name: EnvLogAggregateIDs, Doc: "true: consumers add aggregate ids to their logs (default false: they may carry personal data)"},
}

// Config is how fifobox reaches a NATS server or cluster and what layout it
// uses there.
type Config struct {
	// URL is one or more server URLs, comma-separated: nats://host:4222, or
	// tls://host:4222 to require TLS. Required.
	URL string
	// Topology is the layout (see Topology.Prepare). Required.
	Topology Topology
	// CredsFile is a NATS credentials file (user JWT and NKey seed), for
	// servers with decentralised auth (Synadia Cloud, operator mode).
	CredsFile string
	// User and Password, for servers with user/password auth. They may also
	// be in the URL; these take precedence.
	User, Password string
	// Token, for servers with token auth (the Lambdas read it from their
	// Secrets Manager secret; there is no variable for it).
	Token string
	// ConnectionName prefixes the connection names the server shows
	// ("<name>/publisher", "<name>/consumer/<consumer>"). Default "fifobox".
	ConnectionName string
	// DialTimeout bounds one connection attempt. Default 5s.
	DialTimeout time.Duration
	// ReconnectWait is the wait between reconnection attempts after a
	// connection drops (the client reconnects on its own, without limit).
	// Default 250ms.
	ReconnectWait time.Duration
	// ReconnectMaxDelay caps the wait between attempts to open a connection
	// that was never established or was closed. Default 5s.
	ReconnectMaxDelay time.Duration
	// PingInterval is how often a connection pings the server. A third
	// ping sent while two are unanswered drops the connection and the
	// client reconnects: a connection the network silently lost (a
	// partition: no FIN, no RST) is noticed within 2-3 intervals. Default
	// 5s (the client's own default, 2 minutes, leaves a partitioned runner
	// idle for 4-6 minutes).
	PingInterval time.Duration
	// ConnectWait is how long a Publish call waits for a first connection
	// before reporting its messages as retryable failures. Default 5s.
	ConnectWait time.Duration
	// AckTimeout bounds the wait for one PubAck (the caller's context may
	// end it sooner). Default 10s.
	AckTimeout time.Duration
	// TLS overrides the TLS client settings (default: the system roots and
	// the URL's host name, when the URL is tls://).
	TLS *tls.Config
	// InboxPrefix is the prefix of the connections' reply subjects.
	// Default InboxPrefix(User): "_INBOX.<user>" for a user name that is one
	// subject token, so a user's permissions can let it read its own
	// replies only; "_INBOX" otherwise.
	InboxPrefix string
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Wire, if set, publishes every event as this wire profile renders it
	// (its subject, body and headers, Nats-Msg-Id from the profile) to the
	// profile's stream, instead of fifobox's envelope through Topology
	// (pkg/wire; ProfileProvisioner creates the stream).
	Wire *wire.Mapper
}

func (c *Config) setDefaults() {
	if c.ConnectionName == "" {
		c.ConnectionName = "fifobox"
	}
	defd := func(p *time.Duration, v time.Duration) {
		if *p == 0 {
			*p = v
		}
	}
	defd(&c.DialTimeout, 5*time.Second)
	defd(&c.ReconnectWait, 250*time.Millisecond)
	defd(&c.ReconnectMaxDelay, 5*time.Second)
	defd(&c.PingInterval, 5*time.Second)
	defd(&c.ConnectWait, 5*time.Second)
	defd(&c.AckTimeout, 10*time.Second)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first invalid setting; it prepares the topology.
func (c *Config) Validate() error {
	if strings.TrimSpace(c.URL) == "" {
		return fmt.Errorf("URL (%s): required", EnvURL)
	}
	for _, u := range strings.Split(c.URL, ",") {
		p, err := url.Parse(strings.TrimSpace(u))
		if err != nil {
			// url.Parse's error quotes the URL, password and all.
			return fmt.Errorf("URL (%s) %s: %w", EnvURL, redact.URL(u), redact.Error(err, u))
		}
		switch p.Scheme {
		case "nats", "tls", "ws", "wss":
		default:
			return fmt.Errorf("URL (%s) %s: scheme must be nats, tls, ws or wss", EnvURL, redact.URL(u))
		}
		if p.Host == "" {
			return fmt.Errorf("URL (%s) %s: no host", EnvURL, redact.URL(u))
		}
	}
	switch {
	case c.CredsFile != "" && (c.User != "" || c.Password != ""):
		return fmt.Errorf("CredsFile (%s) and User/Password (%s, %s): set one or the other", EnvCredsFile, EnvUser, EnvPassword)
	case c.Token != "" && (c.CredsFile != "" || c.User != ""):
		return fmt.Errorf("Token and CredsFile (%s) or User (%s): set one kind of credentials", EnvCredsFile, EnvUser)
	case (c.User == "") != (c.Password == ""):
		return fmt.Errorf("User (%s) and Password (%s): set both or neither", EnvUser, EnvPassword)
	case c.DialTimeout <= 0:
		return fmt.Errorf("DialTimeout %s: must be positive", c.DialTimeout)
	case c.ReconnectWait <= 0 || c.ReconnectMaxDelay < c.ReconnectWait:
		return fmt.Errorf("ReconnectWait %s, ReconnectMaxDelay %s: need 0 < wait <= max", c.ReconnectWait, c.ReconnectMaxDelay)
	case c.PingInterval < 100*time.Millisecond:
		return fmt.Errorf("PingInterval (%s) %s: must be at least 100ms", EnvPingInterval, c.PingInterval)
	case c.ConnectWait < 0:
		return fmt.Errorf("ConnectWait %s: must not be negative", c.ConnectWait)
	case c.AckTimeout <= 0:
		return fmt.Errorf("AckTimeout %s: must be positive", c.AckTimeout)
	}
	if err := c.Topology.Prepare(); err != nil {
		return fmt.Errorf("topology (%s): %w", EnvTopology, err)
	}
	return c.validateWire()
}

// ConfigFromEnv reads FIFOBOX_NATS_URL (default DefaultURL),
// FIFOBOX_NATS_TOPOLOGY (default "default"), the overrides
// FIFOBOX_NATS_STREAM, FIFOBOX_NATS_SUBJECT_PREFIX and FIFOBOX_NATS_SUBJECT,
// the optional credentials (FIFOBOX_NATS_CREDS, or FIFOBOX_NATS_USER and
// FIFOBOX_NATS_PASSWORD) and FIFOBOX_NATS_PING_INTERVAL (default 5s), and
// validates them. Errors name the variable.
func ConfigFromEnv() (Config, error) {
	c := Config{URL: Env.Get(EnvURL), CredsFile: Env.Get(EnvCredsFile), User: Env.Get(EnvUser), Password: Env.Get(EnvPassword)}
	if c.URL == "" {
		c.URL = DefaultURL
	}
	t, err := LoadTopology(Env.Get(EnvTopology))
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", EnvTopology, err)
	}
	if v := Env.Get(EnvStream); v != "" {
		t.Stream, t.DeadLetterStream = v, ""
	}
	if v := Env.Get(EnvSubjectPrefix); v != "" {
		t.SubjectPrefix = v
	}
	if v := Env.Get(EnvSubject); v != "" {
		t.Subject = v
	}
	c.Topology = t
	if v := Env.Get(EnvPingInterval); v != "" {
		if c.PingInterval, err = time.ParseDuration(v); err != nil {
			return Config{}, fmt.Errorf("%s %q: not a duration (e.g. 5s): %w", EnvPingInterval, v, err)
		}
		if c.PingInterval <= 0 {
			return Config{}, fmt.Errorf("%s %q: must be positive", EnvPingInterval, v)
		}
	}
	if c.Wire, err = wireFromEnv(); err != nil {
		return Config{}, err
	}
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return Config{}, fmt.Errorf("nats config from environment (%s, %s, %s): %w", EnvStream, EnvSubjectPrefix, EnvSubject, err)
	}
	return c, nil
}

// prepare applies defaults and validates; constructors call it.
func (c *Config) prepare() error {
	c.setDefaults()
	return c.Validate()
}

// dial opens a connection named for role. The client reconnects on its own
// after a drop (without limit), re-subscribing and re-sending what it
// buffered; a connection is only replaced when it is closed.
func (c *Config) dial(role string) (*natsgo.Conn, error) {
	log := c.Logger.With("role", role)
	opts := []natsgo.Option{
		natsgo.Name(c.ConnectionName + "/" + role),
		natsgo.Timeout(c.DialTimeout),
		natsgo.MaxReconnects(-1),
		natsgo.ReconnectWait(c.ReconnectWait),
		natsgo.ReconnectJitter(50*time.Millisecond, 250*time.Millisecond),
		natsgo.PingInterval(c.PingInterval),
		natsgo.MaxPingsOutstanding(2),
		natsgo.DisconnectErrHandler(func(_ *natsgo.Conn, err error) {
			if err != nil {
				log.Warn("nats: disconnected; reconnecting", "error", err.Error())
			}
		}),
		natsgo.ReconnectHandler(func(nc *natsgo.Conn) { log.Info("nats: reconnected", "server", nc.ConnectedUrlRedacted()) }),
		natsgo.ErrorHandler(func(_ *natsgo.Conn, _ *natsgo.Subscription, err error) {
			log.Warn("nats: asynchronous error", "error", err.Error())
		}),
	}
	// Decided here, not in setDefaults: the user may come from a secret
	// after the defaults were applied.
	inbox := c.InboxPrefix
	if inbox == "" {
		inbox = InboxPrefix(c.User)
	}
	if inbox != "_INBOX" {
		opts = append(opts, natsgo.CustomInboxPrefix(inbox))
	}
	if c.CredsFile != "" {
		opts = append(opts, natsgo.UserCredentials(c.CredsFile))
	}
	if c.User != "" {
		opts = append(opts, natsgo.UserInfo(c.User, c.Password))
	}
	if c.Token != "" {
		opts = append(opts, natsgo.Token(c.Token))
	}
	if c.TLS != nil {
		opts = append(opts, natsgo.Secure(c.TLS))
	}
	nc, err := natsgo.Connect(c.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redact.URL(c.URL), redact.Error(err, c.URL, c.Password, c.Token))
	}
	return nc, nil
}

// ErrUnavailable is returned (wrapped, retryable) when the server cannot be reached.
var ErrUnavailable = errors.New("nats: server unavailable")

var errClosed = errors.New("nats: closed")

// connector keeps one connection open for a role. The client reconnects a
// dropped connection itself; the connector only dials again when there is
// no connection yet or it was closed, with backoff between failed dials.
type connector struct {
	cfg  *Config
	role string

	mu       sync.Mutex
	nc       *natsgo.Conn
	js       jetstream.JetStream
	failures int
	nextDial time.Time
	lastErr  error
	closed   bool
}

func newConnector(cfg *Config, role string) *connector { return &connector{cfg: cfg, role: role} }

// get returns a connection and its JetStream context, dialling if needed
// and waiting up to wait (or ctx) for the server.
func (c *connector) get(ctx context.Context, wait time.Duration) (*natsgo.Conn, jetstream.JetStream, error) {
	deadline := time.Now().Add(wait)
	for {
		nc, js, retryAt, err := c.try()
		if err == nil {
			return nc, js, nil
		}
		if errors.Is(err, errClosed) || retryAt.After(deadline) {
			return nil, nil, err
		}
		t := time.NewTimer(time.Until(retryAt))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, nil, fmt.Errorf("%w: %v", err, ctx.Err())
		case <-t.C:
		}
	}
}

func (c *connector) try() (*natsgo.Conn, jetstream.JetStream, time.Time, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, nil, time.Time{}, errClosed
	}
	if c.nc != nil && !c.nc.IsClosed() {
		return c.nc, c.js, time.Time{}, nil
	}
	if now := time.Now(); now.Before(c.nextDial) {
		return nil, nil, c.nextDial, fmt.Errorf("%w: %v", ErrUnavailable, c.lastErr)
	}
	nc, err := c.cfg.dial(c.role)
	if err == nil {
		var js jetstream.JetStream
		if js, err = jetstream.New(nc, jetstream.WithPublishAsyncTimeout(c.cfg.AckTimeout), jetstream.WithPublishAsyncMaxPending(4096)); err == nil {
			if c.failures > 0 || c.nc != nil {
				c.cfg.Logger.Info("nats: connected", "role", c.role, "after_failures", c.failures)
			}
			c.failures, c.nc, c.js = 0, nc, js
			return nc, js, time.Time{}, nil
		}
		nc.Close()
	}
	c.failures++
	d := min(c.cfg.ReconnectWait<<min(c.failures-1, 16), c.cfg.ReconnectMaxDelay)
	c.nextDial, c.lastErr = time.Now().Add(d), err
	if c.failures == 1 || c.failures%20 == 0 {
		c.cfg.Logger.Warn("nats: connect failed; retrying", "role", c.role, "failures", c.failures, "retry_in", d.String(), "error", err.Error())
	}
	return nil, nil, c.nextDial, fmt.Errorf("%w: %v", ErrUnavailable, err)
}

func (c *connector) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.nc != nil && !c.nc.IsClosed() {
		// Drain would wait for subscriptions; the publisher has nothing to
		// finish once its callers returned.
		c.nc.Close()
	}
	return nil
}

// multiFilter reports whether the server takes several filter subjects on
// one consumer (NATS 2.10 and later).
func multiFilter(nc *natsgo.Conn) bool {
	v := strings.TrimPrefix(nc.ConnectedServerVersion(), "v")
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return false
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return false
	}
	return major > 2 || major == 2 && minor >= 10
}
