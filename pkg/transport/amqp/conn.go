package amqp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/redact"
	"github.com/fifobox/fifobox/pkg/wire"
)

// Environment variables read by ConfigFromEnv.
const (
	EnvURL      = "FIFOBOX_AMQP_URL"
	EnvTopology = "FIFOBOX_AMQP_TOPOLOGY"
	// EnvLogAggregateIDs is read by Transport.Consumer.
	EnvLogAggregateIDs = "FIFOBOX_LOG_AGGREGATE_IDS"
)

// Env declares the variables ConfigFromEnv and Transport.Consumer read
// (pkg/envspec: the Lambdas' runtime contract tests check every read
// against the deployment).
var Env = envspec.Set{
	{Name: EnvURL, Doc: "amqp://user:password@host:5672/vhost, or amqps://host:5671/vhost for Amazon MQ (default " + DefaultURL + ")"},
	{Name: EnvTopology, Doc: "built-in topology (default, holdco, ticketing, corewrite), a JSON file, or the JSON itself (default: default)"},
	{Name: EnvLogAggregateIDs, Doc: "true: consumers add aggregate ids to their logs (default false: they may carry personal data)"},
}

// DefaultURL is the local broker's fifobox vhost (scripts/ensure-rabbitmq.sh creates it).
const DefaultURL = "amqp://guest:guest@127.0.0.1:5672/fifobox"

// Config is how fifobox reaches a RabbitMQ broker and what layout it uses there.
type Config struct {
	// URL is amqp://user:password@host:5672/vhost, or amqps://...:5671/vhost
	// for Amazon MQ (TLS only). Percent-encode reserved characters in the
	// password. Required.
	URL string
	// Topology is the layout (see Topology.Prepare). Required.
	Topology Topology
	// ConnectionName prefixes the connection names the broker shows
	// ("<name>/publisher", "<name>/consumer/<consumer>"). Default "fifobox".
	ConnectionName string
	// Heartbeat is the AMQP heartbeat interval; a dead peer is noticed within
	// about twice this. Default 10s.
	Heartbeat time.Duration
	// DialTimeout bounds connecting and the AMQP handshake. Default 10s.
	DialTimeout time.Duration
	// ReconnectDelay is the first wait after a failed connection attempt; it
	// doubles up to ReconnectMaxDelay. Defaults 100ms and 5s.
	ReconnectDelay    time.Duration
	ReconnectMaxDelay time.Duration
	// ConnectWait is how long a Publish call waits for a lost connection to
	// come back before it reports its messages as retryable failures.
	// Default 5s (well inside the dispatcher's 20s PublishTimeout).
	ConnectWait time.Duration
	// MaxMessageBytes: a bigger body is a permanent failure (the broker would
	// close the channel on it). Default 16 MiB, RabbitMQ 4's max_message_size.
	MaxMessageBytes int
	// TLS overrides the TLS client settings for amqps URLs (default: the
	// system roots and the URL's host name).
	TLS *tls.Config
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Wire, if set, publishes every event as this wire profile renders it
	// (its exchange, routing key, body, headers and properties) instead of
	// fifobox's envelope through Topology (pkg/wire; ProfileProvisioner
	// declares the profile's entities).
	Wire *wire.Mapper

	// Users are the functions' broker users the Provisioner creates or
	// updates (through the management API, as URL's administrator), each
	// with its role's permissions on URL's vhost. Empty: none.
	Users []User
	// ManagementURL is the RabbitMQ management API, for Users. Default:
	// https://<host> for an amqps URL (Amazon MQ, port 443), else
	// http://<host>:15672.
	ManagementURL string
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
	defd(&c.Heartbeat, 10*time.Second)
	defd(&c.DialTimeout, 10*time.Second)
	defd(&c.ReconnectDelay, 100*time.Millisecond)
	defd(&c.ReconnectMaxDelay, 5*time.Second)
	defd(&c.ConnectWait, 5*time.Second)
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = 16 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first invalid setting; it prepares the topology.
func (c *Config) Validate() error {
	if c.URL == "" {
		return fmt.Errorf("URL (%s): required", EnvURL)
	}
	if _, err := amqp091.ParseURI(c.URL); err != nil {
		// ParseURI's error quotes the URL, password and all.
		return fmt.Errorf("URL (%s) %s: %w", EnvURL, redact.URL(c.URL), redact.Error(err, c.URL))
	}
	switch {
	case c.Heartbeat < time.Second:
		return fmt.Errorf("Heartbeat %s: must be at least 1s", c.Heartbeat)
	case c.DialTimeout <= 0:
		return fmt.Errorf("DialTimeout %s: must be positive", c.DialTimeout)
	case c.ReconnectDelay <= 0 || c.ReconnectMaxDelay < c.ReconnectDelay:
		return fmt.Errorf("ReconnectDelay %s, ReconnectMaxDelay %s: need 0 < delay <= max", c.ReconnectDelay, c.ReconnectMaxDelay)
	case c.ConnectWait < 0:
		return fmt.Errorf("ConnectWait %s: must not be negative", c.ConnectWait)
	case c.MaxMessageBytes < 1024:
		return fmt.Errorf("MaxMessageBytes %d: must be at least 1024", c.MaxMessageBytes)
	}
	if err := c.Topology.Prepare(); err != nil {
		return fmt.Errorf("topology (%s): %w", EnvTopology, err)
	}
	return c.validateWire()
}

// ConfigFromEnv reads FIFOBOX_AMQP_URL (default DefaultURL, the local
// broker) and FIFOBOX_AMQP_TOPOLOGY (a built-in name, "default", "holdco",
// "ticketing" or "corewrite", or a JSON file; default "default") and
// validates them. Errors name the variable.
func ConfigFromEnv() (Config, error) {
	c := Config{URL: Env.Get(EnvURL)}
	if c.URL == "" {
		c.URL = DefaultURL
	}
	t, err := LoadTopology(Env.Get(EnvTopology))
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", EnvTopology, err)
	}
	c.Topology = t
	if c.Wire, err = wireFromEnv(); err != nil {
		return Config{}, err
	}
	c.setDefaults()
	return c, c.Validate()
}

// prepare applies defaults and validates; constructors call it.
func (c *Config) prepare() error {
	c.setDefaults()
	return c.Validate()
}

// dial opens a connection named for role.
func (c *Config) dial(role string) (*amqp091.Connection, error) {
	props := amqp091.NewConnectionProperties()
	props.SetClientConnectionName(c.ConnectionName + "/" + role)
	conn, err := amqp091.DialConfig(c.URL, amqp091.Config{
		Heartbeat:       c.Heartbeat,
		Locale:          "en_US",
		Properties:      props,
		Dial:            amqp091.DefaultDial(c.DialTimeout),
		TLSClientConfig: c.TLS,
	})
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redact.URL(c.URL), redact.Error(err, c.URL))
	}
	return conn, nil
}

// ErrUnavailable is returned (wrapped, retryable) when the broker cannot be reached.
var ErrUnavailable = errors.New("amqp: broker unavailable")

// connector keeps one connection open for a role, redialling with backoff
// after it drops. It never holds its lock across a blocking wait for a
// caller's context, so Close and other callers are not stuck behind a dial.
type connector struct {
	cfg  *Config
	role string

	mu       sync.Mutex
	conn     *amqp091.Connection
	gen      uint64 // increments per new connection
	failures int
	nextDial time.Time
	lastErr  error
	closed   bool
}

func newConnector(cfg *Config, role string) *connector { return &connector{cfg: cfg, role: role} }

// get returns an open connection and its generation, dialling if needed and
// waiting up to wait (or ctx) for the broker to come back.
func (c *connector) get(ctx context.Context, wait time.Duration) (*amqp091.Connection, uint64, error) {
	deadline := time.Now().Add(wait)
	for {
		conn, gen, retryAt, err := c.try()
		if err == nil {
			return conn, gen, nil
		}
		if errors.Is(err, errClosed) || retryAt.After(deadline) {
			return nil, 0, err
		}
		t := time.NewTimer(time.Until(retryAt))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, 0, fmt.Errorf("%w: %v", err, ctx.Err())
		case <-t.C:
		}
	}
}

var errClosed = errors.New("amqp: closed")

// try returns the open connection, or dials once if the backoff allows, or
// says when the next attempt may run.
func (c *connector) try() (*amqp091.Connection, uint64, time.Time, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, 0, time.Time{}, errClosed
	}
	if c.conn != nil && !c.conn.IsClosed() {
		return c.conn, c.gen, time.Time{}, nil
	}
	if now := time.Now(); now.Before(c.nextDial) {
		return nil, 0, c.nextDial, fmt.Errorf("%w: %v", ErrUnavailable, c.lastErr)
	}
	conn, err := c.cfg.dial(c.role)
	if err != nil {
		c.failures++
		d := c.cfg.ReconnectDelay << min(c.failures-1, 16)
		if d > c.cfg.ReconnectMaxDelay || d <= 0 {
			d = c.cfg.ReconnectMaxDelay
		}
		c.nextDial, c.lastErr = time.Now().Add(d), err
		if c.failures == 1 || c.failures%20 == 0 {
			c.cfg.Logger.Warn("amqp: connect failed; retrying", "role", c.role, "failures", c.failures, "retry_in", d.String(), "error", err.Error())
		}
		return nil, 0, c.nextDial, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if c.failures > 0 || c.gen > 0 {
		c.cfg.Logger.Info("amqp: connected", "role", c.role, "after_failures", c.failures)
	}
	c.failures, c.conn = 0, conn
	c.gen++
	return conn, c.gen, time.Time{}, nil
}

func (c *connector) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.conn != nil && !c.conn.IsClosed() {
		return c.conn.Close()
	}
	return nil
}
